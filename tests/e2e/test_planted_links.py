"""End to end: a link planted at a name the trainer writes is never written through (round-3 reliability, classes 1
and 8), and runs whose epoch/step saves can have the same names exclude each other.

Each case plants a symbolic (or hard) link to a "victim" outside the output folder, at the name of one file the
trainer creates or truncates, and checks that the victim is byte-identical afterwards and that the run stopped with
exit 2 naming the link, before the model loads where the name is known at the start; or, where replacing is the
documented behaviour (a sample PNG, temporaries of an interrupted save), that the link was replaced or removed as a
link. Before this change the lock file, the console log and the sample PNG overwrote their victims, the TensorBoard
folder and the sample folder put files into the victim folder, the LoRA and state names were silently renamed over,
``.old-`` / ``.tmp-`` links stayed behind (or were restored as the state folder) and colliding names both ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import train_network
from library.config.cli import write_config_file
from library.families import model_setup
from library.sampling import images
from library.train import tracking
from tests.e2e.test_train_network import refused as _fails
from tests.e2e.test_train_network import train_args
from tests.unit.base.test_files import HOLDER

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")

PRECIOUS = b"precious: not the trainer's file\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(PRECIOUS)
    return victim


def _victim_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "elsewhere" / "victim_folder"
    folder.mkdir(parents=True)
    (folder / "keep.txt").write_bytes(PRECIOUS)
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _no_model(monkeypatch) -> None:
    monkeypatch.setattr(model_setup, "load_model", lambda *a, **k: pytest.fail("the model loaded"))


def _out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_linked_lock_file_is_refused_before_loading(tmp_path, capsys, monkeypatch, kind):
    victim, out = _victim(tmp_path), _out(tmp_path)
    (os.symlink if kind == "symlink" else os.link)(victim, out / "lora.lock")
    _no_model(monkeypatch)
    err = _fails(capsys, train_args(out), f"the lock file {out / 'lora.lock'}")
    assert ("symbolic link" if kind == "symlink" else "other hard link") in err
    assert victim.read_bytes() == PRECIOUS and "precious" not in err
    assert os.path.lexists(out / "lora.lock")  # left for the user to look at


@pytest.mark.parametrize("name", ["lora.safetensors", "lora-step00000001.safetensors"])
def test_a_link_at_a_lora_file_name_is_refused_before_loading(tmp_path, capsys, monkeypatch, name):
    victim, out = _victim(tmp_path), _out(tmp_path)
    (out / name).symlink_to(victim)
    _no_model(monkeypatch)
    _fails(capsys, train_args(out, "--save_every_n_steps", "1"), f"{out / name} is a symbolic link (to {victim})")
    assert victim.read_bytes() == PRECIOUS
    assert sorted(p.name for p in out.iterdir()) == [name]  # no lock, nothing else


def test_a_link_at_a_state_folder_name_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    folder, out = _victim_folder(tmp_path), _out(tmp_path)
    (out / "lora-state").symlink_to(folder, target_is_directory=True)
    _no_model(monkeypatch)
    _fails(capsys, train_args(out, "--save_state"), f"{out / 'lora-state'} is a symbolic link")
    assert _tree(folder) == {"keep.txt": PRECIOUS}


def test_links_left_at_temporary_names_are_removed_as_links(tmp_path):
    """A state folder renamed aside (``.old-``) or being written (``.tmp-``) that is a link: removed at the start,
    never restored as the state folder, never followed."""
    folder, out = _victim_folder(tmp_path), _out(tmp_path)
    (out / "lora-state.old-77-0badcafe").symlink_to(folder, target_is_directory=True)  # its final name is absent
    (out / "lora-000001-state").mkdir()
    (out / "lora-000001-state.old-77-0badcafe").symlink_to(folder, target_is_directory=True)
    (out / "lora-step00000001-state.tmp-77-0badcafe").symlink_to(folder, target_is_directory=True)
    assert train_network.main(train_args(out, "--max_train_steps", "1", "--save_state")) == 0
    assert _tree(folder) == {"keep.txt": PRECIOUS}
    assert sorted(p.name for p in out.iterdir()) == ["lora-000001-state", "lora-state", "lora.safetensors"]
    assert not any(p.is_symlink() for p in out.iterdir())
    assert sorted(p.name for p in (out / "lora-state").iterdir()) == ["state.safetensors", "train_state.json"]


def _prompts(tmp_path: Path) -> Path:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square --w 64 --h 64 --d 1 --s 2\n", encoding="utf-8")
    return prompts


def test_a_linked_sample_folder_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    folder, out = _victim_folder(tmp_path), _out(tmp_path)
    (out / "sample").symlink_to(folder, target_is_directory=True)
    _no_model(monkeypatch)
    _fails(capsys, train_args(out, "--sample_prompts", str(_prompts(tmp_path)), "--sample_at_first"),
           f"{out / 'sample'} is a symbolic link")
    assert _tree(folder) == {"keep.txt": PRECIOUS}


def test_a_link_at_a_sample_image_name_is_replaced_not_followed(tmp_path, monkeypatch):
    victim, out = _victim(tmp_path), _out(tmp_path)
    (out / "sample").mkdir()
    (out / "sample" / "fixed.png").symlink_to(victim)  # the real name holds the time: fix it
    monkeypatch.setattr(images, "sample_file_name", lambda *a, **k: "fixed.png")
    args = train_args(out, "--max_train_steps", "1", "--sample_prompts", str(_prompts(tmp_path)), "--sample_at_first")
    assert train_network.main(args) == 0
    assert victim.read_bytes() == PRECIOUS
    png = out / "sample" / "fixed.png"
    assert not png.is_symlink() and png.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in (out / "sample").iterdir()) == ["fixed.png"]


def test_a_linked_console_log_file_is_refused(tmp_path, capsys, monkeypatch):
    victim, log_file = _victim(tmp_path), tmp_path / "train.log"
    log_file.symlink_to(victim)
    _no_model(monkeypatch)
    _fails(capsys, train_args(tmp_path / "out", "--console_log_file", str(log_file)),
           f"--console_log_file {log_file} is a symbolic link")
    assert victim.read_bytes() == PRECIOUS
    assert not (tmp_path / "out").exists()


def test_a_link_at_the_tensorboard_folder_name_is_refused(tmp_path, capsys, monkeypatch):
    folder, logs = _victim_folder(tmp_path), tmp_path / "logs"
    logs.mkdir()
    (logs / "run20300101000000").symlink_to(folder, target_is_directory=True)
    monkeypatch.setattr(tracking, "time", types.SimpleNamespace(strftime=lambda fmt: "20300101000000"))
    _fails(capsys, train_args(_out(tmp_path), "--logging_dir", str(logs), "--log_prefix", "run"),
           f"{logs / 'run20300101000000'} is a symbolic link")
    assert _tree(folder) == {"keep.txt": PRECIOUS}


def test_output_config_is_not_written_through_a_dangling_link(tmp_path):
    """``write_config_file`` is what ``--output_config`` runs (``train_network.main``); a link to a missing file
    passed the old ``exists()`` check and the TOML was created where the link pointed."""
    from library.base.errors import UserError

    target, link = tmp_path / "elsewhere" / "created.toml", tmp_path / "new.toml"
    target.parent.mkdir()
    link.symlink_to(target)
    with pytest.raises(UserError, match=rf"--output_config: {link} is a symbolic link"):
        write_config_file(str(link), {"network_dim": 4})
    assert not target.exists() and link.is_symlink()


def _hold(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    return holder


@pytest.mark.parametrize("held,ours,shared", [
    ("lora", "lora-000001", "lora-000001"),  # the held run's epoch-1 save is our final file
    ("lora-step00000002", "lora", "lora-step00000002"),  # our step-2 save is the held run's final file
    ("last", "epoch", "epoch-000001"),  # the unnamed run saves epoch-000001, as --output_name epoch does
    ("epoch", None, "epoch-000001"),
])
def test_runs_whose_saves_share_names_exclude_each_other(tmp_path, capsys, monkeypatch, held, ours, shared):
    out = _out(tmp_path)
    holder = _hold(out / f"{held}.lock")
    try:
        args = train_args(out)
        at = args.index("--output_name")
        if ours is None:
            del args[at:at + 2]
        else:
            args[at + 1] = ours
        _no_model(monkeypatch)
        _fails(capsys, args, f"process {holder.pid}", f"{held}.lock", f"{shared}.<ext>")
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [f"{held}.lock"]
