"""Names with an image extension that are no image file (a named pipe, a looping or dangling link, a folder) are left
out of the dataset with a warning naming each; before, they were dropped without a word."""

from __future__ import annotations

import os

import pytest

from library.data.images import list_images
from tests.unit.data.test_data_latent_cache import data_for


def _warnings(caplog, path) -> list[str]:
    return [r.message for r in caplog.records if r.levelname == "WARNING" and str(path) in r.message]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_fifo_and_a_looping_link_are_named_when_the_dataset_is_scanned(tmp_path, make_folder, caplog):
    folder = make_folder("train/2_x", 2)
    os.mkfifo(folder / "pipe.png")  # opening it would wait for a writer forever
    (folder / "loop.png").symlink_to(folder / "loop.png")
    (folder / "gone.jpg").symlink_to(folder / "missing.jpg")
    (folder / "album.webp").mkdir()
    data = data_for(tmp_path)
    assert len(data) == 2 * 2  # the two images, 2 repeats
    for name, what in (("pipe.png", "a named pipe (FIFO)"), ("loop.png", "a symbolic link that loops"),
                       ("gone.jpg", "a dangling symbolic link"), ("album.webp", "a folder")):
        warned = _warnings(caplog, folder / name)
        assert len(warned) == 1, (name, caplog.text)
        assert f"{what}, not an image file; left out of the dataset" in warned[0]


def test_a_second_listing_does_not_warn_again(tmp_path, caplog):
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    assert list_images(tmp_path, warn=False) == []
    assert not _warnings(caplog, tmp_path / "loop.png")
