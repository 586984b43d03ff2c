"""Generator of ``upstream_finetune_steps.json`` / ``.safetensors``: two optimizer steps of upstream sd-scripts'
(48d368fa) ``fine_tune.py`` in fp32 on the upstream harness (random-weight SD1.5 diffusers folder, the 8 captioned
256 px images), with the flags of ``FLAGS``; run with upstream's Python, not ours.

What runs (upstream's code, nothing copied): ``finetune/merge_captions_to_metadata.py`` writes the ``--in_json``
metadata of the images (``--caption_extension .txt``); then ``fine_tune.py``'s own ``setup_parser``,
``verify_command_line_training_args``, ``read_config_from_file`` and ``train`` in this process, as its ``__main__``
calls them, with two recorders on accelerate's ``Accelerator``: ``backward`` keeps each step's loss,
``clip_grad_norm_`` each step's gradient norm (before clipping, as it returns it). The flags: U-Net and text
encoder trained (``--train_text_encoder``), plain ``torch.optim.SGD`` (``--optimizer_type SGD``: upstream's "any
torch.optim class" path; the update is the learning rate times the clipped gradient, no optimizer state), default
clipping at norm 1, fp32, seed 42, batch 1, the latents cached in memory (``--cache_latents``: without it
upstream's ``FineTuningDataset`` stops at train_util.py:2290, no latents caching strategy set; and only with
``--full_path`` keys, as here, can it find the images without ``.npz`` files), two steps, one ``.safetensors``
checkpoint in the LDM layout. Then the start as upstream would save it: ``train_util.load_target_model`` on the
same folder and ``model_util.save_stable_diffusion_checkpoint`` of it (no training).

Recorded (``upstream_finetune_steps.json``): the flags (placeholders in braces for the harness paths), both losses
and gradient norms, each step's caption, the CPU kernel set (``torch.backends.cpu.get_cpu_capability()``), the
saved file's metadata keys, and per tensor of the saved file: dtype, shape, SHA-256 of its bytes, SHA-256 of the
start's bytes, and of its change from the start (trained minus start, in float64): the sum, the largest magnitude
and how many elements changed.
``upstream_finetune_steps.safetensors`` holds the trained values of the few tensors of ``KEPT`` and per step what
went into ``get_noise_noisy_latents_and_timesteps`` (under 2 MB).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES= \\
        "$PEER_DIR/venv/bin/python" <this repository>/tests/data/upstream_finetune_steps.py [--keep DIR]

``--peer_dir`` defaults to ``$PEER_DIR``, ``--upstream_dir`` to its ``sd-scripts``, ``--data_dir`` (where the
results go) to this file's folder; ``--keep DIR`` keeps upstream's trained and start checkpoints there (4.3 GB each).
About 2 minutes of one CPU core and 10 GB of memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
STEPS = 2
OUTPUT_NAME = "ft"
FLAGS = [
    "--pretrained_model_name_or_path", "{model}", "--tokenizer_cache_dir", "{tokenizer_cache}",
    "--in_json", "{in_json}", "--train_data_dir", "{images}", "--output_dir", "{output_dir}",
    "--output_name", OUTPUT_NAME, "--save_model_as", "safetensors", "--resolution", "256",
    "--train_batch_size", "1", "--mixed_precision", "no", "--seed", "42", "--max_data_loader_n_workers", "0",
    "--max_train_steps", str(STEPS), "--optimizer_type", "SGD", "--learning_rate", "1e-2", "--train_text_encoder",
    "--cache_latents",
]
KEPT = (
    "model.diffusion_model.input_blocks.0.0.weight",
    "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
    "model.diffusion_model.middle_block.1.norm.bias",
    "model.diffusion_model.out.2.weight",
    "model.diffusion_model.out.2.bias",
    "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.bias",
    "cond_stage_model.transformer.text_model.encoder.layers.11.mlp.fc1.bias",
    "cond_stage_model.transformer.text_model.final_layer_norm.weight",
    "first_stage_model.encoder.conv_in.bias",
)


def flags_for(peer: Path, in_json: Path, output_dir: Path) -> list[str]:
    """``FLAGS`` with the harness's paths filled in."""
    places = {"model": peer / "model" / "sd15-random", "tokenizer_cache": peer / "model" / "tokenizer_cache",
              "in_json": in_json, "images": peer / "data" / "10_sks", "output_dir": output_dir}
    return [flag.format(**{k: str(v) for k, v in places.items()}) for flag in FLAGS]


def write_metadata(upstream: Path, images: Path, in_json: Path) -> None:
    """Upstream's ``merge_captions_to_metadata.py`` on the images (keys: full paths), in its own process; a JSON
    already there is replaced, not merged into."""
    in_json.unlink(missing_ok=True)
    subprocess.run([sys.executable, str(upstream / "finetune" / "merge_captions_to_metadata.py"), str(images),
                    str(in_json), "--caption_extension", ".txt", "--full_path"], check=True, cwd=upstream)


def train_upstream(argv: list[str]) -> tuple[dict[str, list], dict]:
    """Upstream ``fine_tune.py`` as its ``__main__`` runs it, recording per step: the loss, the gradient norm, the
    batch's image keys, and what went into ``get_noise_noisy_latents_and_timesteps``: the latents, the state of
    torch's global CPU generator it drew from, and what it drew (noise, timesteps)."""
    from accelerate import Accelerator

    import fine_tune
    from library import train_util

    recorded: dict[str, list] = {"loss": [], "grad_norm": [], "captions": []}
    tensors: dict = {}
    backward, clip = Accelerator.backward, Accelerator.clip_grad_norm_
    draw, collate = train_util.get_noise_noisy_latents_and_timesteps, train_util.collator_class.__call__

    def recording_backward(self, loss, **kwargs):
        recorded["loss"].append(loss.detach().float().item())
        return backward(self, loss, **kwargs)

    def recording_clip(self, parameters, max_norm, norm_type=2):
        norm = clip(self, parameters, max_norm, norm_type)
        recorded["grad_norm"].append(norm.detach().float().item())
        return norm

    def recording_collate(self, examples):
        recorded["captions"].append(list(examples[0]["captions"]))
        return collate(self, examples)

    def recording_draw(args, noise_scheduler, latents):
        import torch

        step = len(recorded["loss"])
        tensors[f"step{step}.rng_state"] = torch.get_rng_state().clone()
        tensors[f"step{step}.latents"] = latents.detach().float().clone().contiguous()
        noise, noisy, timesteps = draw(args, noise_scheduler, latents)
        tensors[f"step{step}.noise"] = noise.detach().float().clone().contiguous()
        tensors[f"step{step}.timesteps"] = timesteps.detach().clone().contiguous()
        return noise, noisy, timesteps

    Accelerator.backward, Accelerator.clip_grad_norm_ = recording_backward, recording_clip
    train_util.get_noise_noisy_latents_and_timesteps, train_util.collator_class.__call__ = recording_draw, \
        recording_collate
    try:
        parser = fine_tune.setup_parser()
        args = parser.parse_args(argv)
        train_util.verify_command_line_training_args(args)
        args = train_util.read_config_from_file(args, parser)
        fine_tune.train(args)
    finally:
        Accelerator.backward, Accelerator.clip_grad_norm_ = backward, clip
        train_util.get_noise_noisy_latents_and_timesteps, train_util.collator_class.__call__ = draw, collate
    if len(recorded["loss"]) != STEPS or len(recorded["grad_norm"]) != STEPS:
        raise RuntimeError(f"expected {STEPS} steps, recorded {recorded}")
    recorded["captions"] = recorded["captions"][:STEPS]
    return recorded, tensors


def save_start(argv: list[str], path: Path) -> None:
    """The untrained model as upstream's ``fine_tune.py`` loads and saves it: ``load_target_model`` (fp32) and
    ``save_stable_diffusion_checkpoint`` with no source file, so the VAE comes from memory as in training."""
    import torch
    from accelerate import Accelerator

    import fine_tune
    from library import model_util, train_util

    args = fine_tune.setup_parser().parse_args(argv)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    text_encoder, vae, unet, _ = train_util.load_target_model(args, torch.float32, accelerator)
    model_util.save_stable_diffusion_checkpoint(False, str(path), text_encoder, unet, None, 0, 0, None, None, vae)


def tensor_record(trained, start) -> dict:
    """Bytes digests of the trained and start tensors and the change between them (float64)."""
    change = trained.double() - start.double()
    return {"dtype": str(trained.dtype).removeprefix("torch."), "shape": list(trained.shape),
            "sha256": hashlib.sha256(trained.contiguous().view(-1).numpy().tobytes()).hexdigest(),
            "start_sha256": hashlib.sha256(start.contiguous().view(-1).numpy().tobytes()).hexdigest(),
            "change_sum": change.sum().item(), "change_max": change.abs().max().item(),
            "changed": int((change != 0).sum().item())}


def checkpoint_record(trained_path: Path, start_path: Path) -> tuple[dict, list[str], dict]:
    """Per tensor records of the trained file against the start file, its metadata keys and the ``KEPT`` tensors."""
    from safetensors import safe_open

    records, kept = {}, {}
    with safe_open(str(trained_path), "pt") as trained, safe_open(str(start_path), "pt") as start:
        if set(trained.keys()) != set(start.keys()):
            raise RuntimeError("the trained and the start checkpoints have different keys")
        for key in sorted(trained.keys()):
            value = trained.get_tensor(key)
            records[key] = tensor_record(value, start.get_tensor(key))
            if key in KEPT:
                kept[key] = value.contiguous()
        metadata_keys = sorted((trained.metadata() or {}).keys())
    return records, metadata_keys, kept


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_argument("--peer_dir", default=os.environ.get("PEER_DIR"))
    cli.add_argument("--upstream_dir", default=None)
    cli.add_argument("--data_dir", default=str(Path(__file__).resolve().parent))
    cli.add_argument("--keep", default=None, help="folder to keep upstream's trained and start checkpoints in")
    opts = cli.parse_args()
    if not opts.peer_dir:
        sys.exit("give --peer_dir or set PEER_DIR (the upstream harness)")
    peer, data = Path(opts.peer_dir).resolve(), Path(opts.data_dir).resolve()
    upstream = Path(opts.upstream_dir).resolve() if opts.upstream_dir else peer / "sd-scripts"
    sys.path.insert(0, str(upstream))
    os.chdir(upstream)
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(opts.keep).resolve() if opts.keep else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        in_json = work / "meta.json"
        write_metadata(upstream, peer / "data" / "10_sks", in_json)
        argv = flags_for(peer, in_json, work / "out")
        steps, drawn = train_upstream(argv)
        save_start(argv, work / "start.safetensors")
        records, metadata_keys, kept = checkpoint_record(work / "out" / f"{OUTPUT_NAME}.safetensors",
                                                         work / "start.safetensors")
    save_file({**kept, **drawn}, str(data / "upstream_finetune_steps.safetensors"))
    record = {
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: fine_tune.py (setup_parser, train) with FLAGS on the "
        "upstream harness, called by tests/data/upstream_finetune_steps.py",
        "flags": FLAGS, "steps": STEPS, "loss": steps["loss"], "grad_norm": steps["grad_norm"],
        "captions": steps["captions"],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
        "metadata_keys": metadata_keys, "kept": list(KEPT), "tensors": records,
    }
    (data / "upstream_finetune_steps.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    changed = sum(1 for r in records.values() if r["changed"])
    print(f"losses {steps['loss']}, grad norms {steps['grad_norm']}; {len(records)} tensors, {changed} changed")


if __name__ == "__main__":
    main()
