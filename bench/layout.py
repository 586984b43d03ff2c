"""Figures of the code's layout: modules per folder, the longest functions and files, module-level import cycles,
imports that point up the layers.

    python -m bench.layout            # the table (``tests/unit/test_layout.py`` checks the rules on the same graph)

The import graph is read from the source with ``ast``: an edge for every ``import`` and ``from … import`` of
``library``, ``networks`` or ``optimizers``; a ``from pkg import name`` points at ``pkg`` (whose ``__init__`` runs
first) and, when ``name`` is a submodule, at it too. ``top_level_only`` keeps the imports that run when the module
is imported (not those inside functions, nor under ``if TYPE_CHECKING:``), which are the ones that can form a cycle.

``LAYERS`` is the layer order of docs/architecture.md, lowest first: a module may import its own package and the
packages of lower layers. Packages on one layer import none of each other (none does), so that either could move
below the other. A module belongs to the longest entry that is its name or a package above it; the commands written as
modules of ``library/`` (``tiny_model``, the ``report`` package, ``assets``' tokenizer rewriter) are the top layer.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("library", "networks", "optimizers")
LAYERS = (
    ("library",),  # ``library/__init__.py``: it runs before any module of library/
    ("library.base", "optimizers"),
    ("networks",),
    ("library.text", "library.config"),
    ("library.objectives",),
    ("library.families",),
    ("library.data",),
    ("library.train",),
    ("library.saving", "library.sampling"),
    ("library.runtime",),
    ("library.report", "library.tiny_model", "library.assets"),
)


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the three packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runs_on_import(tree: ast.Module) -> list[ast.stmt]:
    """The statements executed when the module is imported: the top level, minus ``if TYPE_CHECKING:`` bodies."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        else:
            out.append(node)
    return out


def imports_of(name: str, path: Path, known: set[str], top_level_only: bool) -> set[str]:
    """The modules of ours that module ``name`` (file ``path``) imports."""
    tree = ast.parse(path.read_text())
    nodes = _runs_on_import(tree) if top_level_only else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)  # ``from pkg import x`` runs pkg/__init__ first, also when x is a submodule
            found |= {f"{source}.{alias.name}" for alias in node.names} & known
    return {target for target in found if target.split(".")[0] in PACKAGES and target != name}


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, set(known), top_level_only) for name, path in known.items()}


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted; [] when there is none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def layer_of(name: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> tuple[int, str] | None:
    """(layer index, package) of module ``name``: the longest entry of ``layers`` that is the name or one of its
    packages; None when no entry holds it."""
    found = [(len(entry), index, entry) for index, entries in enumerate(layers) for entry in entries
             if name == entry or name.startswith(entry + ".")]
    return max(found)[1:] if found else None


def upward_imports(graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every edge of ``graph`` that breaks the layering, as "importer -> imported (why)", sorted: into a higher
    layer, into another package of the same layer, or from or to a module that has no layer."""
    wrong = []
    for name, targets in graph.items():
        for target in targets:
            source, dest = layer_of(name, layers), layer_of(target, layers)
            if source is None or dest is None:
                why = "no layer"
            elif dest[0] > source[0]:
                why = f"{source[1]} is below {dest[1]}"
            elif dest[0] == source[0] and dest[1] != source[1]:
                why = f"{source[1]} and {dest[1]} share a layer"
            else:
                continue
            wrong.append(f"{name} -> {target} ({why})")
    return sorted(wrong)


def lengths() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, where) of every function and of every file, longest first."""
    functions, files = [], []
    for path in modules().values():
        text = path.read_text()
        where = path.relative_to(ROOT)
        files.append((len(text.splitlines()), str(where)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.append((node.end_lineno - node.lineno + 1, f"{where}:{node.lineno} {node.name}"))
    return sorted(functions, reverse=True), sorted(files, reverse=True)


def main() -> None:
    per_folder = collections.Counter(str(p.parent.relative_to(ROOT)) for p in modules().values())
    print("| folder | modules |\n|---|---|")
    for folder, count in sorted(per_folder.items()):
        print(f"| {folder}/ | {count} |")
    functions, files = lengths()
    print("\nlongest functions:", *(f"  {n} lines  {where}" for n, where in functions[:5]), sep="\n")
    print("longest files:", *(f"  {n} lines  {where}" for n, where in files[:5]), sep="\n")
    cycles = module_cycles(import_graph(top_level_only=True))
    print(f"module-level import cycles: {len(cycles)}", *(" -> ".join(c) for c in cycles), sep="\n  ")
    upward = upward_imports(import_graph(top_level_only=False))
    print(f"imports against the layers (also in functions and under TYPE_CHECKING): {len(upward)}", *upward,
          sep="\n  ")


if __name__ == "__main__":
    main()
