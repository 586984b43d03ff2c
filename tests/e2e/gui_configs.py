"""The kohya_ss GUI's training TOMLs made runnable in a test folder (shared by the SD 1.5 and SDXL GUI tests)."""

from __future__ import annotations

import shutil
from pathlib import Path


def fill_gui_config(toml: Path, where: Path, images: Path, model: str, prompt: str = "") -> Path:
    """A GUI TOML with its placeholders filled in, in a fresh folder ``where`` holding a copy of ``images``; the
    sample prompt file as the GUI creates it (``prompt``, empty unless its "Sample prompts" box was set)."""
    where.mkdir(parents=True)
    shutil.copytree(images, where / "data")
    (where / "out" / "sample").mkdir(parents=True)
    (where / "out" / "sample" / "prompt.txt").write_text(prompt, encoding="utf-8")
    text = toml.read_text(encoding="utf-8")
    for placeholder, value in {"@PRETRAINED_MODEL@": model, "@TRAIN_DATA_DIR@": where / "data",
                               "@OUTPUT_DIR@": where / "out", "@LOGGING_DIR@": where / "logs"}.items():
        text = text.replace(placeholder, str(value).replace("\\", "/"))
    file = where / "config_lora.toml"
    file.write_text(text, encoding="utf-8")
    return file
