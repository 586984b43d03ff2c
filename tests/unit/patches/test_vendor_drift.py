"""The patch series in patches/: its vendored optimizer copy equals what patches/vendor.py makes from optimizers/
now (no upstream checkout needed), and the series is well-formed and pinned to the commit the README names."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PATCHES = ROOT / "patches"


def load_vendor():
    spec = importlib.util.spec_from_file_location("patches_vendor", PATCHES / "vendor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def series() -> list[Path]:
    names = [line.split("#", 1)[0].strip() for line in (PATCHES / "series").read_text().splitlines()]
    return [PATCHES / name for name in names if name]


def pinned_commit() -> str:
    match = re.search(r"^PINNED_COMMIT=([0-9a-f]{40})$", (PATCHES / "lib.sh").read_text(), re.MULTILINE)
    assert match, "patches/lib.sh has no PINNED_COMMIT"
    return match.group(1)


def new_files(patch: Path) -> dict[str, str]:
    """Path -> text of every file a format-patch adds (each as one @@ -0,0 +1,N @@ hunk)."""
    lines = patch.read_text(encoding="utf-8").split("\n")
    files: dict[str, str] = {}
    index = 0
    while index < len(lines):
        if not lines[index].startswith("+++ b/"):
            index += 1
            continue
        path = lines[index][len("+++ b/"):]
        hunk = re.fullmatch(r"@@ -0,0 \+1(?:,(\d+))? @@.*", lines[index + 1])
        assert hunk, f"{patch.name}: {path} is not a new file"
        count = int(hunk.group(1) or 1)
        body = lines[index + 2:index + 2 + count]
        assert all(line.startswith("+") for line in body), f"{patch.name}: {path}: hunk shorter than {count} lines"
        text = "\n".join(line[1:] for line in body)
        after = index + 2 + count
        no_newline = after < len(lines) and lines[after].startswith("\\ No newline")
        files[path] = text if no_newline else text + "\n"
        index = after
    return files


def vendor_patch() -> Path:
    candidates = [patch for patch in series() if "library/sr_optimizers/" in patch.read_text(encoding="utf-8")
                  and all(line.startswith("diff --git a/library/sr_optimizers/")
                          for line in patch.read_text(encoding="utf-8").splitlines()
                          if line.startswith("diff --git "))]
    assert len(candidates) == 1, f"expected one vendored-optimizer patch, found {[c.name for c in candidates]}"
    return candidates[0]


def test_vendored_copy_matches_optimizers_package():
    expected = load_vendor().generate()
    shipped = new_files(vendor_patch())
    assert sorted(shipped) == sorted(expected), "file lists differ: run patches/make.sh UPSTREAM_DIR"
    stale = [path for path in expected if shipped[path] != expected[path]]
    assert not stale, f"vendored copy is stale for {stale}: run patches/make.sh UPSTREAM_DIR"


def test_vendored_copy_names_no_top_level_optimizers_package():
    for path, text in load_vendor().generate().items():
        assert not re.search(r"^\s*(from|import) optimizers\b", text, re.MULTILINE), path
        assert text.startswith("# Generated from sd-scripts-bf16 optimizers/"), path


def test_vendor_rewrite_refuses_unhandled_forms():
    vendor = load_vendor()
    with pytest.raises(vendor.VendorError):
        vendor.rewrite("import optimizers\n", "x.py")
    rewritten = vendor.rewrite('from optimizers.rounding import a\nf("optimizers.adamw")\n', "x.py")
    assert "from library.sr_optimizers.rounding import a" in rewritten
    assert '"library.sr_optimizers.adamw"' in rewritten


def test_series_is_complete_and_pinned():
    patches = series()
    assert patches, "patches/series is empty"
    on_disk = sorted(PATCHES.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    assert sorted(patches) == on_disk, "patches/series and the *.patch files differ"
    commit = pinned_commit()
    readme = (PATCHES / "README.md").read_text(encoding="utf-8")
    assert commit[:8] in readme, "patches/README.md does not name the pinned commit"
    for number, patch in enumerate(patches, start=1):
        text = patch.read_text(encoding="utf-8")
        if number == 1:  # format-patch --base puts the trailer in the first patch
            assert f"base-commit: {commit}" in text, f"{patch.name}: not made against {commit[:8]}"
        subject = re.search(r"^Subject: \[PATCH (\d+)/(\d+)\] (.+)$", text, re.MULTILINE)
        assert subject and int(subject.group(1)) == number and int(subject.group(2)) == len(patches), patch.name
        body = text.split("\n\n", 1)[1].split("\n---\n", 1)[0]
        assert len(body.split()) >= 30, f"{patch.name}: the commit message needs a body"
        assert patch.name in readme, f"patches/README.md does not describe {patch.name}"


def test_scripts_are_strict_bash():
    for script in ("check.sh", "make.sh", "lib.sh"):
        text = (PATCHES / script).read_text()
        if script != "lib.sh":
            assert "set -euo pipefail" in text, script
        subprocess.run(["bash", "-n", str(PATCHES / script)], check=True)


def test_check_sh_usage_without_arguments():
    result = subprocess.run(["bash", str(PATCHES / "check.sh")], capture_output=True, text=True)
    assert result.returncode == 2 and "UPSTREAM_DIR" in result.stdout


def test_check_sh_refuses_a_directory_that_is_not_sd_scripts(tmp_path):
    result = subprocess.run(["bash", str(PATCHES / "check.sh"), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "not a git repository" in result.stderr
