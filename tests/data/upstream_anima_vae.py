"""Generator of ``upstream_anima_vae.safetensors`` / ``.json``: upstream sd-scripts' own Qwen-Image VAE (Anima's VAE)
at a tiny width, weights from a fixed seed, what it encodes and decodes; plus the real model's keys in the layout of
the file users have (run with upstream's Python, not ours).

What is recorded (upstream 48d368fa ``library/qwen_image_autoencoder_kl.py`` called, nothing copied):

1. ``load_vae``'s fixed config (its ``VAE_CONFIG_JSON``) and ``convert_comfyui_state_dict``'s key map (its
   ``key_map``), both read from upstream's source with ``ast`` (they are local to the functions).
2. The real model's state dict (``AutoencoderKLQwenImage(**config)`` on the meta device), key -> shape, its parameter
   count, and the official file's keys (ComfyUI / Wan names): every model key whose module prefix is a value of the
   map gets that value's key; checked by running ``convert_comfyui_state_dict`` on them, which must give back exactly
   the model's keys.
3. The tiny VAE (``TINY_CONFIG``: the real config at ``base_dim`` 4, so every module and the map's indices are the
   real ones), every parameter from one seeded generator in key order (RMS-norm gammas ``1 + 0.1 randn``, biases
   ``0.1 randn``, conv weights ``randn / sqrt(fan_in)``), bf16-valued, stored as bf16 in the ComfyUI names and loaded
   from a temporary file by ``load_vae``'s steps (``load_safetensors``, ``convert_comfyui_state_dict``, strict
   ``load_state_dict``), as ``load_vae`` builds only the real config.
4. ``encode_pixels_to_latents`` of seeded pixels in [-1, 1] (4D, non-square) and the posterior mode before the
   normalization; ``decode_to_pixels`` of seeded 5D latents (as the sampler passes them) and the tensor it hands to
   ``decode`` (the denormalized latents); the same in bfloat16 (the VAE cast as the trainers cast it); in fp32 with
   ``spatial_chunk_size`` ``CHUNK`` (even, as ``load_vae`` makes it) and with ``disable_cache``, stored only where
   they change a bit (``bit_equal_to_plain``); the input shape of every convolution of the chunked encode and
   decode (the bands upstream cuts), and the bands of single chunked convs at heights where the last band's rule
   decides (``BAND_CASES``).

    cd "$PEER_DIR/sd-scripts" && PYTHONPATH="$PEER_DIR/shim:." "$PEER_DIR/venv/bin/python" \\
        <this repository>/tests/data/upstream_anima_vae.py [--upstream_dir DIR] [--data_dir DIR]

A few seconds of CPU.
"""

from __future__ import annotations

import ast
import inspect
import json
import tempfile
from pathlib import Path

UPSTREAM_COMMIT = "48d368fa"
TINY_BASE_DIM = 4
PIXELS_SHAPE = (2, 3, 32, 24)
LATENTS_SHAPE = (2, 16, 1, 4, 3)
CHUNK = 6
BAND_CASES = [("up2d", 18, 8), ("up2d", 9, 2), ("up2d", 20, 8), ("down2d", 17, 8), ("down2d", 19, 8),
              ("down2d", 9, 2), ("down2d", 33, 6), ("causal3d", 10, 4), ("causal3d", 11, 4), ("causal3d", 4, 4)]


def function_constant(function, name: str):
    """The literal assigned to ``name`` inside ``function``'s source."""
    tree = ast.parse(inspect.getsource(function))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(name)


def model_kwargs(config: dict) -> dict:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def comfy_keys(model_keys: list[str], key_map: dict) -> list[str]:
    """Each model key in the file's names: its module prefix replaced by the map key that maps onto it."""
    inverse = {v: k for k, v in key_map.items()}
    assert len(inverse) == len(key_map)
    out = []
    for key in model_keys:
        prefix, leaf = key.rsplit(".", 1)
        out.append(f"{inverse[prefix]}.{leaf}" if prefix in inverse else key)
    return out


def real_facts(qwen_vae, config: dict, key_map: dict) -> dict:
    import torch

    with torch.device("meta"):
        model = qwen_vae.AutoencoderKLQwenImage(**model_kwargs(config))
    state = model.state_dict()
    file_keys = comfy_keys(list(state), key_map)
    back = qwen_vae.convert_comfyui_state_dict({k: None for k in file_keys})
    assert list(back) == list(state), "upstream's map does not give the model's keys back"
    return {"real_state_shapes": [[k, list(v.shape)] for k, v in state.items()],
            "real_file_keys": [[f, list(v.shape)] for f, v in zip(file_keys, state.values(), strict=True)],
            "real_parameters": sum(p.numel() for p in model.parameters()),
            "unmapped_keys": [k for k, f in zip(state, file_keys, strict=True) if k == f]}


def tiny_weights(qwen_vae, config: dict) -> dict:
    import torch

    model = qwen_vae.AutoencoderKLQwenImage(**model_kwargs(config))
    gen = torch.Generator().manual_seed(0)
    params = dict(model.named_parameters())
    state = {}
    for key in sorted(params):
        shape = params[key].shape
        noise = torch.randn(shape, generator=gen)
        if key.endswith(".bias"):
            state[key] = 0.1 * noise
        elif key.endswith(".gamma"):
            state[key] = 1.0 + 0.1 * noise
        else:
            state[key] = noise / (shape[1:].numel() ** 0.5)
    return {k: state[k].to(torch.bfloat16) for k in params}


def load_tiny(qwen_vae, config: dict, file: Path, dtype, **options):
    """``load_vae``'s steps with the tiny config (its own config is fixed): build, read the file, rename, load
    strictly, cast as the trainers do."""
    from library.safetensors_utils import load_safetensors

    vae = qwen_vae.AutoencoderKLQwenImage(**model_kwargs(config), **options)
    state = qwen_vae.convert_comfyui_state_dict(load_safetensors(str(file), device="cpu", disable_mmap=True))
    vae.load_state_dict(state, strict=True, assign=True)
    vae.to(dtype)
    vae.eval()
    return vae


def run(vae, pixels, latents, tag: str) -> dict:
    """Encode and decode with ``vae``, the decoder's input captured on the way."""
    import torch

    seen = {}
    decode = vae.decode

    def capture(z, return_dict=True):
        seen["z"] = z.clone()
        return decode(z, return_dict=return_dict)

    with torch.no_grad():
        raw = vae.encode(pixels.unsqueeze(2).to(vae.dtype), return_dict=False)[0].mode()
        encoded = vae.encode_pixels_to_latents(pixels)
        vae.decode = capture
        decoded = vae.decode_to_pixels(latents)
    return {f"raw_mode{tag}": raw, f"latents{tag}": encoded, f"decode_input{tag}": seen["z"],
            f"decoded{tag}": decoded}


def conv_calls(vae, pixels, latents) -> dict:
    """The input shape of every 2D / 3D convolution (``torch.nn.functional``) run by an encode and a decode: with
    chunking on, the bands upstream cuts."""
    import torch
    import torch.nn.functional as F

    calls = {}
    originals = {"conv2d": F.conv2d, "conv3d": F.conv3d}

    def spy(kind, seen):
        def call(x, *args, **kwargs):
            seen.append([kind, list(x.shape)])
            return originals[kind](x, *args, **kwargs)
        return call

    for step in ("encode", "decode"):
        seen = calls[step] = []
        try:
            F.conv2d, F.conv3d = spy("conv2d", seen), spy("conv3d", seen)
            with torch.no_grad():
                vae.encode_pixels_to_latents(pixels) if step == "encode" else vae.decode_to_pixels(latents)
        finally:
            F.conv2d, F.conv3d = originals["conv2d"], originals["conv3d"]
    return calls


def band_cases(qwen_vae) -> list:
    """The input heights upstream's ``ChunkedConv2d`` (a resample's conv: padding 1 stride 1, or padding 0 stride 2)
    and ``QwenImageCausalConv3d`` (3x3x3, padding 1) convolve for each ``BAND_CASES`` entry (kind, height, chunk
    size), including heights where the last band's rest rule decides."""
    import torch
    import torch.nn.functional as F

    out = []
    for kind, height, size in BAND_CASES:
        if kind == "causal3d":
            conv = qwen_vae.QwenImageCausalConv3d(2, 2, 3, padding=1, spatial_chunk_size=size)
            x, function = torch.zeros(1, 2, 1, height, 5), "conv3d"
        else:
            options = {"padding": 1} if kind == "up2d" else {"stride": 2}
            conv = qwen_vae.ChunkedConv2d(2, 2, 3, spatial_chunk_size=size, **options)
            x, function = torch.zeros(1, 2, height, 5), "conv2d"
        original, heights = getattr(F, function), []

        def spy(t, *args, _original=original, _heights=heights, **kwargs):
            _heights.append(t.shape[-2])
            return _original(t, *args, **kwargs)

        setattr(F, function, spy)
        try:
            with torch.no_grad():
                conv(x)
        finally:
            setattr(F, function, original)
        out.append([kind, height, size, heights])
    return out


def main() -> None:
    from upstream_session import enter_upstream

    out_dir = enter_upstream(__doc__.split("\n")[0])
    import torch
    from safetensors.torch import save_file

    from library import qwen_image_autoencoder_kl as qwen_vae

    config = json.loads(function_constant(qwen_vae.load_vae, "VAE_CONFIG_JSON"))
    key_map = function_constant(qwen_vae.convert_comfyui_state_dict, "key_map")
    facts = real_facts(qwen_vae, config, key_map)
    tiny_config = dict(config, base_dim=TINY_BASE_DIM)
    weights = tiny_weights(qwen_vae, tiny_config)
    names = dict(zip(weights, comfy_keys(list(weights), key_map), strict=True))
    file_state = {names[k]: v.contiguous() for k, v in weights.items()}
    gen = torch.Generator().manual_seed(1)
    pixels = torch.rand(PIXELS_SHAPE, generator=gen) * 2 - 1
    latents = torch.randn(LATENTS_SHAPE, generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "tiny_vae.safetensors"
        save_file(file_state, str(file))
        out = {"pixels": pixels, "noise_latents": latents}
        out.update(run(load_tiny(qwen_vae, tiny_config, file, torch.float32), pixels, latents, ""))
        out.update(run(load_tiny(qwen_vae, tiny_config, file, torch.bfloat16), pixels, latents, "_bf16"))
        chunked = load_tiny(qwen_vae, tiny_config, file, torch.float32, spatial_chunk_size=CHUNK)
        out.update(run(chunked, pixels, latents, "_chunked"))
        chunked_calls = conv_calls(chunked, pixels, latents)
        nocache = load_tiny(qwen_vae, tiny_config, file, torch.float32, disable_cache=True)
        out.update(run(nocache, pixels, latents, "_nocache"))
    same = {tag: {name: bool(torch.equal(out[f"{name}_{tag}"], out[name])) for name in ("latents", "decoded")}
            for tag in ("chunked", "nocache")}
    for tag in ("chunked", "nocache"):
        if all(same[tag].values()):
            for name in ("raw_mode", "latents", "decode_input", "decoded"):
                del out[f"{name}_{tag}"]
    tensors = {k: v.detach().clone().contiguous() for k, v in out.items()}
    tensors.update({f"vae.{k}": v for k, v in file_state.items()})
    save_file(tensors, str(out_dir / "upstream_anima_vae.safetensors"))
    facts.update({
        "source": f"kohya-ss/sd-scripts {UPSTREAM_COMMIT}: qwen_image_autoencoder_kl.load_vae, "
        "convert_comfyui_state_dict, AutoencoderKLQwenImage.encode_pixels_to_latents / decode_to_pixels, called by "
        "tests/data/upstream_anima_vae.py",
        "real_config": config, "key_map": key_map, "tiny_config": tiny_config, "chunk": CHUNK,
        "chunked_conv_calls": chunked_calls, "band_cases": band_cases(qwen_vae), "bit_equal_to_plain": same,
        "decoded_clamped_fraction": float((out["decoded"].abs() == 1).float().mean()), "torch": torch.__version__,
    })
    (out_dir / "upstream_anima_vae.json").write_text(json.dumps(facts, indent=1) + "\n")
    size = (out_dir / "upstream_anima_vae.safetensors").stat().st_size
    print(f"wrote {len(tensors)} tensors ({size / 1e6:.2f} MB), {len(facts['real_file_keys'])} real keys, "
          f"{facts['real_parameters']:,} parameters; same as plain: {same}")


if __name__ == "__main__":
    main()
