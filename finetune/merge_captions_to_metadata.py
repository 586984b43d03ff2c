"""Write the captions of a folder of images into a fine-tuning metadata file (``--in_json`` of ``fine_tune.py``,
``metadata_file`` of a dataset TOML), as sd-scripts' ``finetune/merge_captions_to_metadata.py`` (48d368fa) does,
with its arguments and output: each image's ``<name><caption_extension>`` text, stripped, becomes the "caption" of
its entry (key: the file name without extension, or the path with ``--full_path``), in the existing metadata of
``--in_json`` (or of ``out_json`` when it exists) or a new file.

    python finetune/merge_captions_to_metadata.py TRAIN_DATA_DIR OUT_JSON [--in_json IN_JSON]
        [--caption_extension .caption] [--full_path [--recursive]] [--debug]

``--caption_extention`` (upstream's old spelling) overrides ``--caption_extension`` when given. Behaviour and the
differences from upstream (clear errors instead of tracebacks): ``library/data/metadata_json.py``. Exit codes: 0
written, 2 bad input (nothing written).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("out_json", type=str, help="metadata file to write")
    parser.add_argument("--in_json", type=str,
                        help="metadata file to start from (default: out_json when it exists, else an empty one)")
    parser.add_argument("--caption_extention", type=str, default=None,
                        help="old spelling of --caption_extension; overrides it when given")
    parser.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files")
    parser.add_argument("--full_path", action="store_true",
                        help="key each image by its path instead of its file name (images of several folders)")
    parser.add_argument("--recursive", action="store_true",
                        help="also take the images of every sub-folder of train_data_dir (needs --full_path)")
    parser.add_argument("--debug", action="store_true", help="log each image's key and caption")
    return parser


def main(argv: list[str] | None = None) -> int:
    from library.data.metadata_json import merge_command
    from library.runtime.console_log import setup_logging

    setup_logging()
    args = setup_parser().parse_args(argv)
    if args.caption_extention is not None:
        return merge_command(args, "caption", args.caption_extention, "--caption_extention", log.info)
    return merge_command(args, "caption", args.caption_extension, "--caption_extension", log.info)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
