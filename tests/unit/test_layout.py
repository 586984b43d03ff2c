"""The layout's rules, checked on the source: no import cycle between modules, the layers import only downwards
(``optimizers/`` nothing of ours, ``networks/`` only ``library.base``, the packages of ``library/`` in
docs/architecture.md's order), and every module imports by itself.

The import graph is read from the source with ``ast`` (``bench/layout.py`` prints the same figures for people).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.family_names import identifier_words, mentions, shared_mentions
from bench.layout import (
    LAYERS,
    ROOT,
    import_graph,
    imports_of,
    layer_of,
    lengths,
    module_cycles,
    modules,
    upward_imports,
)

BASE = "library.base"
# docs/architecture.md's order of the packages of library/, lowest first; a comma joins the packages of one layer.
LIBRARY_ORDER = "base → text, config → objectives → families → data → train → saving, sampling → runtime → report"


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


def test_the_layer_table_is_the_architecture_order():
    """``bench/layout.py``'s table puts the packages of library/ in docs/architecture.md's order, below them the root
    ``library/__init__``; ``optimizers/`` (nothing of ours) shares the base's layer, ``networks/`` (only
    ``library.base``) has the next; the commands written as modules of library/ (``tiny_model``, ``assets``'
    tokenizer rewriter) sit with ``report``."""
    base, *order = [{f"library.{name.strip()}" for name in layer.split(",")} for layer in LIBRARY_ORDER.split("→")]
    order[-1] |= {"library.tiny_model", "library.assets"}
    assert [set(layer) for layer in LAYERS] == [{"library"}, base | {"optimizers"}, {"networks"}, *order]


def test_packages_import_downwards_only():
    """Every import of ours (at module level, in functions, under ``if TYPE_CHECKING:``) goes to the importer's own
    package or to a lower layer: ``base`` -> ``text``, ``config`` -> ``objectives`` -> ``families`` -> ``data`` ->
    ``train`` -> ``saving``, ``sampling`` -> ``runtime`` -> ``report`` and the commands. Packages that share a layer
    (``text`` and ``config``; ``saving`` and ``sampling``; ``base`` and ``optimizers``) import none of each other,
    and every module has a layer."""
    assert [name for name in modules() if layer_of(name) is None] == []
    assert upward_imports(import_graph(top_level_only=False)) == []


def test_an_import_against_the_layers_is_found_when_there_is_one():
    layers = (("p.low",), ("p.mid", "p.side"), ("p.high",))
    graph = {"p.mid.a": {"p.mid.b", "p.low.x", "p.high.y", "p.side"}, "p.high.y": {"p.mid.a", "q.z"}}
    assert layer_of("p.mid.a", layers) == (1, "p.mid") and layer_of("p.middle", layers) is None
    assert upward_imports(graph, layers) == ["p.high.y -> q.z (no layer)",
                                             "p.mid.a -> p.high.y (p.mid is below p.high)",
                                             "p.mid.a -> p.side (p.mid and p.side share a layer)"]


def test_no_family_is_named_outside_the_families():
    """The loop, the saver and the sampler never ask which family they run (docs/architecture.md): no code of library/
    outside library/families/ names one (``bench/family_names.py``)."""
    assert shared_mentions() == []


def test_a_family_named_in_code_is_found():
    source = (
        '"""The sd family\'s docstring is prose."""\n'
        'from library.families.flux.config import FluxConfig\n'
        'suffix = "_sdxl"  # a comment naming sdxl is prose too\n'
        'if spec.name == "sd":\n'
        '    table = {"flux": 16}\n'
        'def sdxl_rule(): ...\n'
        'state_dict = weights_sd = load("library.families.sd.loading")\n'
        'fine = "sd-scripts"\n')
    assert mentions(source, ["sd", "sdxl", "flux"], ["sd", "sdxl", "flux", "_sdxl"]) == [2, 3, 4, 5, 6, 7]
    assert identifier_words("SDXLConfig") == ["sdxl", "config"] and identifier_words("msd_loss") == ["msd", "loss"]


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


def _cross_family_imports(graph: dict[str, set[str]], families: set[str]) -> list[str]:
    """The imports in ``graph`` from a module of one family package (``library.families.<family>``) into another."""
    def family_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if parts[:2] == ["library", "families"] and len(parts) > 2 and parts[2] in families else None

    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if family_of(module) and family_of(target) not in (None, family_of(module)))


def test_no_family_package_imports_another():
    """A family (a package directly under ``library/families/``) imports only its own modules and the shared ones
    beside it: what several families use lives in a shared module of ``library/families/``, not in one family."""
    families = {path.name for path in (ROOT / "library" / "families").iterdir() if (path / "__init__.py").is_file()}
    assert len(families) >= 3
    planted = {"library.families.b.loading": {"library.families.a.parts", "library.families.a",
                                              "library.families.model_files", "library.families.b.parts"},
               "library.families.model_files": {"library.families.a.parts"}}
    assert _cross_family_imports(planted, {"a", "b"}) == ["library.families.b.loading -> library.families.a",
                                                         "library.families.b.loading -> library.families.a.parts"]
    assert _cross_family_imports(import_graph(top_level_only=False), families) == []
