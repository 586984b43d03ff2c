"""The layout's rules, checked on the source: no import cycle between modules, the layers import only downwards
(``optimizers/`` nothing of ours, ``networks/`` only ``library.base``), and every module imports by itself.

The import graph is read from the source with ``ast`` (``bench/layout.py`` prints the same figures for people).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.layout import ROOT, import_graph, imports_of, lengths, module_cycles, modules

BASE = "library.base"


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("library", "networks", "optimizers")


def test_no_import_cycle_between_modules():
    assert module_cycles(import_graph(top_level_only=True)) == []


def test_no_function_over_80_lines_and_no_file_over_400():
    functions, files = lengths()
    assert [f"{n} lines {where}" for n, where in functions if n > 80] == []
    assert [f"{n} lines {where}" for n, where in files if n > 400] == []


def test_a_cycle_is_found_when_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert module_cycles(graph) == [["a", "b", "c"]]


def test_optimizers_import_nothing_of_library_or_networks():
    graph = import_graph(top_level_only=False)
    wrong = {m: sorted(t for t in targets if t.split(".")[0] in ("library", "networks"))
             for m, targets in graph.items() if m.split(".")[0] == "optimizers"}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_networks_import_only_the_base_of_library():
    graph = import_graph(top_level_only=False)
    wrong = {m: sorted(t for t in targets if t.startswith("library") and not t.startswith(BASE))
             for m, targets in graph.items() if m.split(".")[0] == "networks"}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_base_imports_no_other_layer():
    graph = import_graph(top_level_only=False)
    wrong = {m: sorted(t for t in targets if _ours(t) and not t.startswith(BASE))
             for m, targets in graph.items() if m.startswith(BASE)}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_no_family_is_asked_for_by_name_outside_the_families():
    """The loop, the saver and the sampler never ask which family they run (ARCHITECTURE.md)."""
    asked = []
    for name, path in modules().items():
        if name.startswith("library.families") or not name.startswith("library"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(probe in code for probe in ('== "sdxl"', '!= "sdxl"', '== "sd"', '!= "sd"', ".is_sdxl")):
                asked.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert asked == []


def test_imports_of_reads_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "library" / "pkg"
    package.mkdir(parents=True)
    source = package / "mod.py"
    source.write_text("from . import sibling\nfrom .other import x\n\ndef f():\n    import networks.lora\n")
    assert imports_of("library.pkg.mod", source, {"library.pkg.sibling", "library.pkg.other"}, True) == {
        "library.pkg", "library.pkg.sibling", "library.pkg.other"}
    assert "networks.lora" in imports_of("library.pkg.mod", source, set(), False)


def test_every_module_imports_by_itself():
    """Each module imported with none of ours loaded before it (third-party packages stay loaded, so one interpreter
    serves them all): a partially initialised module (an import cycle through a package) fails here."""
    names = sorted(modules())
    script = (
        "import importlib, json, sys, traceback\n"
        "import torch, diffusers, transformers  # noqa: F401  third-party, loaded once\n"
        "failed = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('library', 'networks', 'optimizers')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except BaseException:\n"
        "        failed[name] = traceback.format_exc(limit=3)\n"
        "print(json.dumps(failed))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, json.dumps(names)], cwd=ROOT, capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
    assert len(names) > 100 and all(isinstance(p, Path) for p in modules().values())
