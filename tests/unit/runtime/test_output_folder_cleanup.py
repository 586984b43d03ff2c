"""``open_output`` removes, when its lock is released, the output folder it created (and the folders above it that it
created) while they are empty; anything written there keeps them, and a folder that existed before is never
removed."""

from __future__ import annotations

from library.runtime.output import open_output
from library.saving.lora_files import OutputNames


def test_created_folders_that_stay_empty_are_removed(tmp_path):
    with open_output(str(tmp_path / "a" / "b" / "out"), OutputNames("lora")):
        assert (tmp_path / "a" / "b" / "out" / "lora.lock").is_file()
    assert list(tmp_path.iterdir()) == []


def test_a_created_folder_holding_a_file_stays(tmp_path):
    with open_output(str(tmp_path / "a" / "out"), OutputNames("lora")):
        (tmp_path / "a" / "out" / "lora.safetensors").write_bytes(b"saved")
    assert [p.name for p in (tmp_path / "a" / "out").iterdir()] == ["lora.safetensors"]


def test_an_empty_folder_that_existed_stays(tmp_path):
    (tmp_path / "out").mkdir()
    with open_output(str(tmp_path / "out"), OutputNames("lora")):
        pass
    assert (tmp_path / "out").is_dir()
