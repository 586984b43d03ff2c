"""Generator of ``upstream_prepare_buckets/``: what upstream sd-scripts' (48d368fa)
``finetune/prepare_buckets_latents.py`` writes and logs for a fixed input (``build_inputs``: images of
``configs/sample_data`` resized to several sizes, one in a sub-folder, and metadata files with captions for some of
them), case after case (``CASES``) in one temporary folder with relative paths, so that no path of this machine lands
in the data. Run with upstream's Python, not ours; upstream's script is run as a subprocess, nothing copied.

    PYTHONPATH="$PEER_DIR/shim" "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_prepare_buckets.py [--upstream_dir DIR] [--model DIR] [--out DIR]

``--upstream_dir`` defaults to ``$PEER_DIR/sd-scripts``, ``--model`` (the model whose VAE upstream loads) to
``$PEER_DIR/model/sd15-random``, ``--out`` to ``upstream_prepare_buckets/`` beside this script. It writes
``<case>.json`` (out_json's bytes as upstream wrote them), ``record.json`` (per case: exit status, the warnings the
script logged, the files it added beside the images; and the outcome of the ``FACTS`` runs, which write no out_json)
and ``parser.json`` (the script's arguments: flags, defaults, actions, types, choices). Some minutes of CPU (the
VAE encodes every image at its bucket size). The tests (``tests/unit/finetune/``) build the same input with
``build_inputs`` and run ours.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "configs" / "sample_data" / "10_shapes"
MODEL = "<model>"  # stands for the model argument in CASES

# image path under the input folder -> (sample image, width, height) it is resized from / to
IMAGES = {
    "data/00_red_circle.png": ("00_red_circle.png", 64, 64),
    "data/01_blue_square.png": ("01_blue_square.png", 96, 64),
    "data/02_green_triangle.png": ("02_green_triangle.png", 64, 160),
    "data/03_yellow_circle.png": ("03_yellow_circle.png", 300, 200),
    "data/04_purple_square.png": ("04_purple_square.png", 40, 40),
    "data/sub/05_orange_triangle.png": ("05_orange_triangle.png", 160, 64),
}
# metadata file -> content: captions for some images, one entry whose image does not exist (kept as it is)
METADATA = {
    "meta.json": {
        "zz_no_image": {"caption": "an entry without an image"},
        "01_blue_square": {"caption": "a blue square", "tags": "blue, square"},
        "00_red_circle": {"caption": "a red circle", "train_resolution": [1, 1]},
        "04_purple_square": {"tags": "purple, ü"},
    },
    "meta_full.json": {
        "data/02_green_triangle.png": {"caption": "a green triangle"},
        "data/sub/05_orange_triangle.png": {"caption": "an orange triangle in a sub-folder"},
        "01_blue_square": {"caption": "a key by name, not by path"},
    },
}
# case -> arguments of the script, run in this order in the input folder
CASES = {
    "defaults": ["data", "meta.json", "out/defaults.json", MODEL],
    "small_buckets": ["data", "meta.json", "out/small_buckets.json", MODEL, "--max_resolution", "256,256",
                      "--min_bucket_reso", "64", "--max_bucket_reso", "512", "--bucket_reso_steps", "32",
                      "--batch_size", "2"],
    "no_upscale": ["data", "meta.json", "out/no_upscale.json", MODEL, "--bucket_no_upscale", "--max_resolution",
                   "256,256", "--bucket_reso_steps", "32"],
    "full_recursive": ["data", "meta_full.json", "out/full_recursive.json", MODEL, "--full_path", "--recursive",
                       "--max_resolution", "256,320", "--min_bucket_reso", "128", "--max_bucket_reso", "512"],
    "flip_aug": ["data", "meta.json", "out/flip_aug.json", MODEL, "--flip_aug", "--max_resolution", "256,256",
                 "--min_bucket_reso", "128", "--mixed_precision", "bf16"],
    "steps_36": ["data", "meta.json", "out/steps_36.json", MODEL, "--bucket_reso_steps", "36", "--max_resolution",
                 "256,256", "--min_bucket_reso", "128", "--max_bucket_reso", "512"],
}
# runs whose outcome is recorded (upstream writes no out_json or fails): fact -> arguments
FACTS = {
    "missing_in_json": ["data", "gone.json", "out/missing_in_json.json", MODEL],
    "skip_existing": ["data", "meta.json", "out/skip_existing.json", MODEL, "--skip_existing",
                      "--max_resolution", "256,256", "--min_bucket_reso", "128"],
    "no_upscale_tiny_image": ["data", "meta.json", "out/no_upscale_tiny_image.json", MODEL, "--bucket_no_upscale",
                              "--max_resolution", "256,256"],
}
# Runs the script as ``python <script> ...`` does, each log record written as one JSON line [logger, level, message].
_WRAPPER = """
import json, logging, runpy, sys
class Lines(logging.Formatter):
    def format(self, record):
        return json.dumps([record.name, record.levelname, record.getMessage()])
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(Lines())
logging.basicConfig(level=logging.INFO, handlers=[handler])
import library.utils
library.utils.setup_logging = lambda *args, **kwargs: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def build_inputs(root: Path) -> None:
    """Write the input folder (``IMAGES``, resized with PIL's LANCZOS and saved as PNG; ``METADATA``) under
    ``root``, with an empty ``out/`` for the outputs."""
    from PIL import Image

    for rel, (sample, width, height) in IMAGES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        with Image.open(SAMPLES / sample) as image:
            image.convert("RGB").resize((width, height), Image.Resampling.LANCZOS).save(root / rel, format="PNG")
    for rel, content in METADATA.items():
        (root / rel).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (root / "out").mkdir()


def arguments(args: list[str], model: str) -> list[str]:
    return [model if arg == MODEL else arg for arg in args]


def files_under(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def run_case(script: Path, args: list[str], root: Path, env: dict[str, str]) -> dict:
    """Run the script once; its exit status, warnings, last stderr line and the files it added under ``data/``."""
    before = files_under(root / "data")
    done = subprocess.run([sys.executable, "-c", _WRAPPER, str(script), *args], cwd=root, env=env,
                          capture_output=True, text=True)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    lines = done.stderr.strip().splitlines()
    return {"returncode": done.returncode,
            "warnings": [message for name, level, message in records if name == "__main__" and level == "WARNING"],
            "errors": [message for name, level, message in records if name == "__main__" and level == "ERROR"],
            "last_stderr_line": lines[-1] if done.returncode and lines else None,
            "added_beside_images": sorted(files_under(root / "data") - before),
            "out_json_written": (root / args[2]).exists()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = os.environ.get("PEER_DIR")
    parser.add_argument("--upstream_dir", default=str(Path(peer) / "sd-scripts") if peer else None,
                        required=not peer)
    parser.add_argument("--model", default=str(Path(peer) / "model" / "sd15-random") if peer else None,
                        required=not peer)
    parser.add_argument("--out", default=str(Path(__file__).with_suffix("")))
    options = parser.parse_args()
    upstream, out, model = Path(options.upstream_dir).resolve(), Path(options.out), options.model
    out.mkdir(exist_ok=True)
    script = upstream / "finetune" / "prepare_buckets_latents.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(upstream)]))}
    record: dict = {"upstream_commit": UPSTREAM_COMMIT, "generator": Path(__file__).name, "cases": {}, "facts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_inputs(root)
        for case, args in CASES.items():
            outcome = run_case(script, arguments(args, model), root, env)
            if outcome["returncode"] != 0 or not outcome["out_json_written"]:
                raise SystemExit(f"{case}: upstream failed: {outcome}")
            (out / f"{case}.json").write_bytes((root / args[2]).read_bytes())
            record["cases"][case] = outcome
            print(f"{case}: done", flush=True)
        for fact, args in FACTS.items():
            record["facts"][fact] = run_case(script, arguments(args, model), root, env)
            print(f"{fact}: {record['facts'][fact]['returncode']}", flush=True)
    (out / "record.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    sys.path.insert(0, str(REPO))
    from tests.data.upstream_finetune_metadata import parser_record  # the metadata tools' generator reads them alike

    (out / "parser.json").write_text(json.dumps(parser_record(upstream, "prepare_buckets_latents"), indent=1) + "\n")
    print(f"wrote {out}: {len(CASES)} cases, {len(FACTS)} facts")


if __name__ == "__main__":
    main()
