"""Generator of ``upstream_flux_fp8_text_cache.safetensors`` / ``.json``: upstream sd-scripts' FLUX.1 text conditioning
under ``--fp8_base --mixed_precision bf16`` for the tiny FLUX.1 model (run with upstream's Python, not ours).

The model is ours: ``python -m library.tiny_model --flux MODEL_DIR`` writes ``clip_l.safetensors`` and
``t5xxl.safetensors`` (and the transformer and AE, which upstream's loaders are kept from reading here: only the text
encoders matter). Upstream 48d368fa code decides everything else (nothing copied):

* ``cached``: ``FluxNetworkTrainer.load_target_model`` then ``cache_text_encoder_outputs_if_needed`` with
  ``--cache_text_encoder_outputs --network_train_unet_only``; the dataset's caching call runs upstream's
  ``FluxTextEncoderOutputsCachingStrategy.cache_batch_outputs`` on ``CAPTIONS`` (what the cache holds).
* ``cached_t5_fp8_file``: the same with a T5-XXL file whose floating tensors are all cast to float8_e4m3fn.
* ``uncached``: ``cache_text_encoder_outputs_if_needed`` without caching, then what ``train_network.py``'s ``train``
  does to each text encoder on a CUDA device under ``--fp8_base`` (``t_enc.to(float8_e4m3fn)`` and
  ``prepare_text_encoder_fp8``; on the CPU it skips them). CPU autocast cannot run fp8 LayerNorm weights, so this
  case records each parameter's dtype, sum and sum of squares (float64) instead of outputs.

Upstream's CLIP-L / T5 configs get the tiny widths and depths of ``library/assets/configs/tiny-flux`` (by wrapping
the ``CLIPConfig`` / ``T5Config`` they call, as ``upstream_flux_parity.py`` does); tokenizers as there.

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_flux_fp8_text_cache.py --model_dir MODEL_DIR \\
        [--upstream_dir DIR] [--clip_tokenizer DIR] [--out_dir DIR]

Defaults as ``upstream_flux_parity.py``'s. A few seconds of CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
TINY_CONFIGS = HERE.parents[1] / "library" / "assets" / "configs" / "tiny-flux"
CAPTIONS = ["a photo of a cat", "Two dogs running along the beach at sunset, watercolor, highly detailed, 4k!", ""]
T5_LENGTH = 24
CLIP_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "projection_dim")
T5_KEYS = ("d_model", "d_ff", "d_kv", "num_heads", "num_layers", "num_decoder_layers")
CASES = ("cached", "cached_t5_fp8_file", "uncached")


class Placeholder:
    """The transformer and AE upstream's trainer moves around (already fp8, so it is not cast)."""

    def __init__(self):
        import torch

        self.dtype, self.device = torch.float8_e4m3fn, torch.device("cpu")

    def to(self, *args, **kwargs):
        return self


class CpuBf16Accelerator:
    """What ``cache_text_encoder_outputs_if_needed`` uses of accelerate's ``Accelerator`` (mixed bf16 on the CPU)."""

    device = None

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def autocast(self):
        import torch

        return torch.autocast("cpu", dtype=torch.bfloat16)

    def wait_for_everyone(self):
        return None


class CaptionDataset:
    """Upstream's ``DatasetGroup`` as far as the trainer uses it here; caching runs the strategy on ``CAPTIONS``."""

    def __init__(self):
        self.infos = [SimpleNamespace(caption=c) for c in CAPTIONS]

    def verify_bucket_reso_steps(self, steps):
        return None

    def is_text_encoder_output_cacheable(self):
        return True

    def new_cache_text_encoder_outputs(self, models, accelerator):
        from library import strategy_base

        strategy_base.TextEncoderOutputsCachingStrategy.get_strategy().cache_batch_outputs(
            strategy_base.TokenizeStrategy.get_strategy(), models, strategy_base.TextEncodingStrategy.get_strategy(),
            self.infos)


def tiny_config_classes():
    """``CLIPConfig`` / ``T5Config`` replacements that give upstream's configs the tiny widths."""
    from transformers import CLIPConfig, T5Config

    clip = json.loads((TINY_CONFIGS / "clip_l.json").read_text())
    t5 = json.loads((TINY_CONFIGS / "t5xxl.json").read_text())
    return (lambda **kw: CLIPConfig(**{**kw, **{k: clip[k] for k in CLIP_KEYS}}),
            lambda **kw: T5Config(**{**kw, **{k: t5[k] for k in T5_KEYS}}))


def fp8_t5_file(source: Path, target: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source))
    save_file({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in tensors.items()}, str(target))
    return target


def run_case(case: str, model_dir: Path, t5_file: Path, cache_dir: Path) -> dict:
    import torch
    from upstream_flux_parity import patched

    import flux_train_network
    from library import flux_utils, strategy_base

    argv = ["--pretrained_model_name_or_path", str(model_dir / "flux1-dev.safetensors"),
            "--clip_l", str(model_dir / "clip_l.safetensors"), "--t5xxl", str(t5_file),
            "--ae", str(model_dir / "ae.safetensors"), "--fp8_base", "--mixed_precision", "bf16",
            "--t5xxl_max_token_length", str(T5_LENGTH), "--tokenizer_cache_dir", str(cache_dir),
            "--network_train_unet_only"]
    if case != "uncached":
        argv.append("--cache_text_encoder_outputs")
    args = flux_train_network.setup_parser().parse_args(argv)
    trainer, dataset, accelerator = flux_train_network.FluxNetworkTrainer(), CaptionDataset(), CpuBf16Accelerator()
    trainer.assert_extra_args(args, dataset, None)
    for kind in (strategy_base.TokenizeStrategy, strategy_base.TextEncodingStrategy,
                 strategy_base.TextEncoderOutputsCachingStrategy):
        kind._strategy = None  # set once per run upstream; each case here is a run
    tokenize_strategy = trainer.get_tokenize_strategy(args)
    strategy_base.TokenizeStrategy.set_strategy(tokenize_strategy)
    strategy_base.TextEncodingStrategy.set_strategy(trainer.get_text_encoding_strategy(args))
    caching = trainer.get_text_encoder_outputs_caching_strategy(args)
    if caching is not None:
        strategy_base.TextEncoderOutputsCachingStrategy.set_strategy(caching)
    small_clip, small_t5 = tiny_config_classes()
    with patched(flux_utils, "CLIPConfig", small_clip), patched(flux_utils, "T5Config", small_t5), \
            patched(flux_utils, "load_flow_model", lambda *a, **k: (False, Placeholder())), \
            patched(flux_utils, "load_ae", lambda *a, **k: Placeholder()):
        _, text_encoders, vae, unet = trainer.load_target_model(args, torch.bfloat16, accelerator)
    trainer.cache_text_encoder_outputs_if_needed(args, accelerator, unet, vae, text_encoders, dataset,
                                                 torch.bfloat16)
    l_ids, t5_ids, mask = tokenize_strategy.tokenize(CAPTIONS)
    out = {"clip_ids": l_ids, "t5_ids": t5_ids, "t5_attn_mask": mask}
    if case == "uncached":
        for i, t_enc in enumerate(text_encoders):  # train_network.py train(), on a CUDA device
            t_enc.to(dtype=torch.float8_e4m3fn)
            trainer.prepare_text_encoder_fp8(i, t_enc, torch.float8_e4m3fn, torch.bfloat16)
        out["weights"] = {f"{part}.{name}": [str(p.dtype), p.double().sum().item(), p.double().square().sum().item()]
                          for part, t_enc in zip(("clip_l", "t5xxl"), text_encoders, strict=True)
                          for name, p in t_enc.named_parameters()}
    else:
        out |= {"l_pooled": torch.stack([torch.from_numpy(i.text_encoder_outputs[0]) for i in dataset.infos]),
                "t5_out": torch.stack([torch.from_numpy(i.text_encoder_outputs[1]) for i in dataset.infos])}
    out["encoder_dtypes"] = [str(text_encoders[0].text_model.encoder.layers[0].mlp.fc1.weight.dtype),
                             str(flux_utils.get_t5xxl_actual_dtype(text_encoders[1]))]
    return out


def main() -> int:
    peer = os.environ.get("PEER_DIR")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_dir", type=Path, required=True, help="python -m library.tiny_model --flux DIR")
    parser.add_argument("--upstream_dir", type=Path, default=Path(peer) / "sd-scripts" if peer else Path.cwd())
    parser.add_argument("--clip_tokenizer", type=Path, default=Path(peer or ".") / "model" / "tokenizer_cache"
                        / "openai_clip-vit-large-patch14")
    parser.add_argument("--out_dir", type=Path, default=HERE)
    args = parser.parse_args()
    sys.path[:0] = [str(args.upstream_dir), str(HERE)]
    os.chdir(args.upstream_dir)
    from safetensors.torch import save_file
    from upstream_flux_parity import UPSTREAM_COMMIT, tokenizers

    tensors, meta = {}, {"upstream_commit": UPSTREAM_COMMIT, "captions": CAPTIONS, "t5_length": T5_LENGTH,
                         "mixed_precision": "bf16", "encoder_dtypes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "tokenizers"
        cache.mkdir()
        tokenizers(args.upstream_dir, args.clip_tokenizer, cache)
        t5_fp8 = fp8_t5_file(args.model_dir / "t5xxl.safetensors", Path(tmp) / "t5xxl_fp8.safetensors")
        for case in CASES:
            t5_file = t5_fp8 if case == "cached_t5_fp8_file" else args.model_dir / "t5xxl.safetensors"
            out = run_case(case, args.model_dir, t5_file, cache)
            meta["encoder_dtypes"][case] = out.pop("encoder_dtypes")
            if "weights" in out:
                meta[f"{case}_weights"] = out.pop("weights")
            tensors |= {f"{case}.{k}": v.contiguous() for k, v in out.items()}
    save_file(tensors, str(args.out_dir / "upstream_flux_fp8_text_cache.safetensors"))
    (args.out_dir / "upstream_flux_fp8_text_cache.json").write_text(json.dumps(meta, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
