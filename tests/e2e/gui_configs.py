"""The kohya_ss GUI's training TOMLs made runnable in a test folder (shared by the GUI tests of the LoRA, DreamBooth
and Finetune tabs)."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import train_network


def fill_gui_config(toml: Path, where: Path, images: Path, model: str, prompt: str = "",
                    placeholders: dict[str, Path] | None = None) -> Path:
    """A GUI TOML with its placeholders filled in, in a fresh folder ``where`` holding a copy of ``images``; the
    sample prompt file as the GUI creates it (``prompt``, empty unless its "Sample prompts" box was set).

    ``placeholders``: more placeholders, or other paths for the usual ones (the Finetune tab's ``@TRAIN_DIR@``, its
    "Train config folder" for the metadata JSON, and a flat image folder as ``@TRAIN_DATA_DIR@``)."""
    where.mkdir(parents=True)
    shutil.copytree(images, where / "data")
    (where / "out" / "sample").mkdir(parents=True)
    (where / "out" / "sample" / "prompt.txt").write_text(prompt, encoding="utf-8")
    text = toml.read_text(encoding="utf-8")
    paths = {"@PRETRAINED_MODEL@": model, "@TRAIN_DATA_DIR@": where / "data", "@OUTPUT_DIR@": where / "out",
             "@LOGGING_DIR@": where / "logs", **(placeholders or {})}
    for placeholder, value in paths.items():
        text = text.replace(placeholder, str(value).replace("\\", "/"))
    file = where / "config_lora.toml"
    file.write_text(text, encoding="utf-8")
    return file


def fill_model_files_config(toml: Path, where: Path, images: Path, files: dict[str, Path], metadata: bool) -> Path:
    """``fill_gui_config`` for a model given as several files (``files``: each file by the placeholder it fills,
    ``@PRETRAINED_MODEL@`` among them); with ``metadata`` (a Finetune tab file) a flat image folder as
    ``@TRAIN_DATA_DIR@`` and its caption metadata in ``@TRAIN_DIR@``, made with the GUI's arguments to
    merge_captions_to_metadata.py."""
    from finetune import merge_captions_to_metadata

    placeholders = dict(files)
    if metadata:
        placeholders |= {"@TRAIN_DATA_DIR@": where / "data" / "10_shapes", "@TRAIN_DIR@": where / "train"}
    file = fill_gui_config(toml, where, images, str(files["@PRETRAINED_MODEL@"]), placeholders=placeholders)
    if metadata:
        (where / "train").mkdir()
        extension = tomllib.loads(toml.read_text(encoding="utf-8"))["caption_extension"]
        code = merge_captions_to_metadata.main(["--caption_extension", extension,
                                                str(placeholders["@TRAIN_DATA_DIR@"]),
                                                str(where / "train" / "meta_cap.json"), "--full_path"])
        if code != 0:
            raise RuntimeError(f"merge_captions_to_metadata.py exited {code}")
    return file


@dataclass(frozen=True)
class ModelFilesGui:
    """The GUI TOMLs of a family whose model is given as files (FLUX.1, Anima), each read, filled in and run as the
    GUI runs it: with the script the GUI starts for it (``scripts``, by the file's name under ``folder``), through
    ``train_network.main``, with the command-line overrides of the GUI tests (``overrides``). ``finetune``: the
    Finetune tab's file, whose caption metadata is made first."""

    folder: Path
    family: str
    scripts: Mapping[str, str]
    finetune: str
    overrides: Sequence[str]

    def values(self, name: str) -> dict:
        return tomllib.loads((self.folder / f"{name}.toml").read_text(encoding="utf-8"))

    def materialise(self, name: str, where: Path, images: Path, files: dict[str, Path]) -> Path:
        """The file with every placeholder filled in, in a fresh folder (``fill_model_files_config``)."""
        return fill_model_files_config(self.folder / f"{name}.toml", where, images, files,
                                       metadata=name == self.finetune)

    def train(self, name: str, where: Path, images: Path, files: dict[str, Path], capsys, *extra: str
              ) -> tuple[int, str]:
        """One run of the file: exit code, and what it printed (stderr, then stdout)."""
        file = self.materialise(name, where, images, files)
        capsys.readouterr()
        rc = train_network.main(["--config_file", str(file), *self.overrides, *extra], family=self.family,
                                script=self.scripts[name])
        captured = capsys.readouterr()
        return rc, captured.err + captured.out
