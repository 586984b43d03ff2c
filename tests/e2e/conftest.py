"""Fixtures shared by the end-to-end tests of the kohya_ss GUI's configs (SD 1.5 and SDXL), and how the end-to-end
tests are spread over pytest-xdist's workers (``make test``: ``--dist loadgroup``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
# A module of more tests than this spreads over the workers even when they share a module fixture: its cases cost more
# than the setup each worker repeats (tests/e2e/test_every_flag.py: 611 one-update runs, three first runs).
SPREAD_FROM = 100


def _shares_module_setup(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture of its own module (a launch, a baseline run)."""
    module = item.nodeid.split("::")[0]
    return any(definition.scope == "module" and definition.baseid == module
               for definitions in item._fixtureinfo.name2fixturedefs.values() for definition in definitions)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tests of an end-to-end module that share a module-scoped setup on one xdist worker
    (``xdist_group``, honoured by ``--dist loadgroup``), so that the setup runs once, not once per worker that
    receives one of its tests; the other tests spread as ``--dist load`` spreads them."""
    here = Path(__file__).parent
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        if here in Path(item.path).parents:
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    for module, tests in modules.items():
        if len(tests) <= SPREAD_FROM and any(_shares_module_setup(test) for test in tests):
            for test in tests:
                test.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="package")
def images(tmp_path_factory) -> Path:
    """configs/sample_data with every image resized to 64x64; captions unchanged."""
    root = tmp_path_factory.mktemp("gui_images")
    shutil.copytree(ROOT / "configs" / "sample_data", root / "data")
    for png in (root / "data").glob("*/*.png"):
        with Image.open(png) as im:
            im.resize((64, 64), Image.BILINEAR).save(png)
    return root / "data"
