"""What is written, where and when: LoRA files, training states and their metadata."""

from __future__ import annotations

from dataclasses import dataclass

from library.config.fields import flag


@dataclass
class SaveConfig:
    """What is written, where, and when."""

    output_dir: str | None = flag(None, "folder for the LoRA files")
    output_name: str | None = flag(None, "file stem of the LoRA (default: last)")
    save_model_as: str = flag("safetensors", "file format of the LoRA", choices=("safetensors", "ckpt", "pt"))
    save_precision: str | None = flag(None, "dtype of the saved LoRA (default: as trained)",
                                      choices=("float", "fp16", "bf16"))
    save_every_n_epochs: int | None = flag(None, "also save every N epochs")
    save_n_epoch_ratio: int | None = flag(None, "save about N times over the run: every floor(epochs / N) epochs "
                                          "(wins over --save_every_n_epochs)")
    save_every_n_steps: int | None = flag(None, "also save every N optimizer updates")
    save_last_n_epochs: int | None = flag(None, "keep only the last N epoch saves")
    save_last_n_epochs_state: int | None = flag(None, "keep only the last N epoch states (default: "
                                                "--save_last_n_epochs)")
    save_last_n_steps: int | None = flag(None, "keep only the step saves of the last N updates")
    save_last_n_steps_state: int | None = flag(None, "keep only the step states of the last N updates (default: "
                                               "--save_last_n_steps)")
    save_state: bool = flag(False, "save optimizer/scheduler/RNG state beside each LoRA save, for --resume")
    save_state_on_train_end: bool = flag(False, "save the training state once at the end (also without "
                                         "--save_state)")
    resume: str | None = flag(None, "resume from a state folder written by --save_state")
    no_metadata: bool = flag(False, "write only the minimal ss_* metadata")
    training_comment: str | None = flag(None, "free text stored as ss_training_comment")
    metadata_title: str | None = flag(None, "modelspec title (default: --output_name)")
    metadata_author: str | None = flag(None, "modelspec author")
    metadata_description: str | None = flag(None, "modelspec description")
    metadata_license: str | None = flag(None, "modelspec license")
    metadata_tags: str | None = flag(None, "modelspec tags, comma separated")
    metadata_usage_hint: str | None = flag(None, "modelspec usage hint")
    metadata_thumbnail: str | None = flag(None, "modelspec thumbnail: a data URL, or an image file (converted to a "
                                          "data URL)")
    metadata_merged_from: str | None = flag(None, "modelspec merged-from (source models)")
    metadata_trigger_phrase: str | None = flag(None, "modelspec trigger phrase")
    metadata_preprocessor: str | None = flag(None, "modelspec preprocessor")
    metadata_is_negative_embedding: str | None = flag(None, "modelspec is-negative-embedding")
