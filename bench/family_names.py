"""Where the shared code names a model family: the lines of ``library/`` outside ``library/families/`` whose code
(comments and docstrings left out) says which family it is about.

    python -m bench.family_names      # the count and the lines (``tests/unit/test_layout.py`` requires none)

A line names a family when its code has
* an identifier with a family's name as one of its words (``sdxl_block_index``, ``FluxConfig``, ``SD_FAMILY``);
* a string that is a family's name or one of its file suffixes (``"flux"``, ``"_sdxl"``, ``"_flux_te.npz"``), or
  that names a family's package (``"library.families.sd.loading"``);
* an import of a family's package (``from library.families.flux.config import ...``).
The families are the registry's (``library/families/registry.py``), so a new family is looked for by itself.
``networks/`` is not read: its modules are the families' LoRA modules by upstream's names (``networks.lora_flux``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable

from bench.layout import ROOT, modules

SHARED = "library"
FAMILIES_PACKAGE = "library.families"
# Upstream's own API names that hold a family's word without naming a family: ``create_network_from_weights``'s
# ``weights_sd`` (a state dict) keyword.
UPSTREAM_NAMES = {"weights_sd"}


def identifier_words(name: str) -> list[str]:
    """The lower-case words of an identifier, split at underscores and where the case changes; a run of capitals
    stays one word (``FluxConfig``: flux, config; ``SDXLConfig``: sdxl, config; ``SD_FAMILY``: sd, family)."""
    words = []
    for part in name.split("_"):
        words += re.findall(r"[A-Z]+(?=[A-Z][a-z]|\d|$)|[A-Z]?[a-z]+|[A-Z]+|\d+", part)
    return [word.lower() for word in words]


def _docstring_lines(tree: ast.Module) -> set[int]:
    """The lines of the module's, classes' and functions' docstrings."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines |= set(range(first.lineno, first.end_lineno + 1))
    return lines


def mentions(source: str, names: Iterable[str], strings: Iterable[str]) -> list[int]:
    """The line numbers of ``source`` whose code names a family: ``names`` the families' names, ``strings`` the
    literal values that stand for one (its name and file suffixes)."""
    names, strings = set(names), set(strings)
    package = re.compile(rf"\b{re.escape(FAMILIES_PACKAGE)}\.({'|'.join(map(re.escape, sorted(names)))})\b")
    tree = ast.parse(source)
    docstrings = _docstring_lines(tree)
    found = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        line = token.start[0]
        if token.type == tokenize.NAME and token.string not in UPSTREAM_NAMES \
                and names & set(identifier_words(token.string)):
            found.add(line)
        elif token.type == tokenize.STRING and line not in docstrings:
            try:
                value = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):  # an f-string: its text is checked as written
                value = token.string
            if isinstance(value, str) and (value in strings or package.search(value)):
                found.add(line)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules_named = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
            if any(module and package.search(module) for module in modules_named):
                found.add(node.lineno)
    return sorted(found)


def family_words() -> tuple[list[str], list[str]]:
    """The registered families' names, and the strings that stand for one (names and cache file suffixes)."""
    from library.families.registry import FAMILIES

    strings = set(FAMILIES)
    for spec in FAMILIES.values():
        strings |= {spec.latent_suffix, f"{spec.latent_suffix}.npz", spec.text_cache_suffix}
    return sorted(FAMILIES), sorted(strings)


def shared_mentions() -> list[str]:
    """Every line of the shared code that names a family, as "path:line: code"."""
    names, strings = family_words()
    out = []
    for name, path in modules().items():
        if not name.startswith(SHARED) or name.startswith(FAMILIES_PACKAGE):
            continue
        source = path.read_text()
        lines = source.splitlines()
        out += [f"{path.relative_to(ROOT)}:{n}: {lines[n - 1].strip()}" for n in mentions(source, names, strings)]
    return out


def main() -> None:
    found = shared_mentions()
    files = {line.split(":")[0] for line in found}
    print(f"lines of library/ outside library/families/ that name a family: {len(found)} in {len(files)} files",
          *found, sep="\n  ")


if __name__ == "__main__":
    main()
