"""Tiny, deterministic models of every family as files, for tests, smoke runs and trying the trainer out.

    python -m library.tiny_model [--FAMILY] OUT_DIR

``--FAMILY`` is a family of ``library/families/registry.py`` (``--sdxl``, ``--flux``; without it the first,
``train_network.py``'s); each family writes its ``builtin:tiny-*`` model in the layouts its users have
(``FamilySpec.write_tiny``: ``library/families/<family>/tiny_files.py``). Weights are generated from a seed, never
downloaded or committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from library.families.registry import FAMILIES
from library.runtime.console_log import hide_known_harmless


def main(argv: list[str]) -> int:
    hide_known_harmless()  # before the models' libraries are imported (bitsandbytes warns at import on some CPUs)
    chosen = [name for name in FAMILIES if argv[:1] == [f"--{name}"]]
    rest = argv[1:] if chosen else argv
    spec = FAMILIES[chosen[0]] if chosen else next(iter(FAMILIES.values()))
    if len(rest) != 1 or rest[0].startswith("-") or spec.write_tiny is None:
        usage = " | ".join(f"--{name}" for name, each in FAMILIES.items() if each.write_tiny is not None)
        print(f"usage: python -m library.tiny_model [{usage}] OUT_DIR", file=sys.stderr)
        return 2
    print(f"wrote {spec.write_tiny(Path(rest[0]))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
