"""A run refused because the output disk is too small for the LoRA (``fs_checks.ensure_room_for_save``) removes the
output folder it created, while it is empty; a folder that existed before the run, or holds anything, stays. Before,
the refused run left an empty output folder (and the folders above it that it created) behind."""

from __future__ import annotations

import shutil

import train_network
from library.base import fs_checks
from tests.e2e.test_train_network import train_args

TOO_LITTLE = "too little for the LoRA"


def _small_disk(monkeypatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(fs_checks.shutil, "disk_usage", lambda path: real(path)._replace(free=2**20))


def test_a_created_output_folder_is_removed_when_the_disk_is_too_small(tmp_path, capsys, monkeypatch):
    _small_disk(monkeypatch)
    assert train_network.main(train_args(tmp_path / "runs" / "out")) == 2
    assert TOO_LITTLE in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # "runs" and "out" were created by the run: both gone


def test_an_existing_output_folder_stays(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    _small_disk(monkeypatch)
    assert train_network.main(train_args(out)) == 2
    assert TOO_LITTLE in capsys.readouterr().err
    assert out.is_dir() and list(out.iterdir()) == []
