"""The toy family's entry script, as ``sdxl_train_network.py`` is SDXL's: ``train_network.py``'s trainer run for the
family called "toy".

    python -m tests.toy_family.toy_train_network --pretrained_model_name_or_path builtin:toy ...

A family of the project is one line of ``library/families/registry.py``; the toy stays out of it, so ``main`` needs
the registry to hold ``tests.toy_family.spec.SPEC`` under "toy" (the tests enter it), and run as a script it enters
it itself.
"""

from __future__ import annotations

import sys

import train_network


def main(argv: list[str] | None = None) -> int:
    return train_network.main(argv, family="toy")


if __name__ == "__main__":
    from library.families.registry import FAMILIES
    from tests.toy_family.spec import SPEC

    FAMILIES[SPEC.name] = SPEC
    sys.exit(main())
