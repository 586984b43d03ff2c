"""Compare Gaussian, offset and multi-resolution (pyramid) training noise: sample maps, radially averaged power
spectra and the spread of the per-map means, for an SD 512 px latent (4 x 64 x 64).

Run from the repository root: ``.venv/bin/python -m bench.noise``; it writes
``bench/results/noise-2026-11-29.png`` and prints its path.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from library.config import NoiseConfig  # noqa: E402
from library.objectives.noise import sample_noise  # noqa: E402

OUTPUT = Path(__file__).resolve().parent / "results" / "noise-2026-11-29.png"
LATENT_SHAPE = (256, 4, 64, 64)
SHOWN = 3

SETTINGS: list[tuple[str, NoiseConfig]] = [
    ("Gaussian", NoiseConfig()),
    ("offset 0.1", NoiseConfig(noise_offset=0.1)),
    ("multires it 6, disc 0.1", NoiseConfig(multires_noise_iterations=6, multires_noise_discount=0.1)),
    ("multires it 6, disc 0.3", NoiseConfig(multires_noise_iterations=6, multires_noise_discount=0.3)),
    ("multires it 6, disc 0.8", NoiseConfig(multires_noise_iterations=6, multires_noise_discount=0.8)),
    ("multires it 1, disc 0.3", NoiseConfig(multires_noise_iterations=1, multires_noise_discount=0.3)),
    ("multires it 10, disc 0.3", NoiseConfig(multires_noise_iterations=10, multires_noise_discount=0.3)),
]


def radial_power_spectrum(maps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean power per integer radial frequency (cycles per map), averaged over all maps [N, H, W]; DC excluded."""
    power = (np.abs(np.fft.fft2(maps)) ** 2).mean(axis=0) / (maps.shape[-2] * maps.shape[-1])
    fy = np.fft.fftfreq(maps.shape[-2]) * maps.shape[-2]
    fx = np.fft.fftfreq(maps.shape[-1]) * maps.shape[-1]
    radius = np.rint(np.hypot(fy[:, None], fx[None, :])).astype(int)
    sums = np.bincount(radius.ravel(), weights=power.ravel())
    counts = np.bincount(radius.ravel())
    keep = np.arange(1, min(maps.shape[-2:]) // 2 + 1)
    return keep, sums[keep] / counts[keep]


def draw(samples: dict[str, np.ndarray]) -> plt.Figure:
    """Sample maps (channel 0 of the first latents) on the left; spectra and per-map means on the right."""
    fig = plt.figure(figsize=(13, 11), dpi=72)
    grid = fig.add_gridspec(len(SETTINGS), SHOWN + 2, width_ratios=[1] * SHOWN + [0.35, 3.6],
                            left=0.05, right=0.98, top=0.93, bottom=0.06, wspace=0.05, hspace=0.12)
    for row, (name, maps) in enumerate(samples.items()):
        for col in range(SHOWN):
            ax = fig.add_subplot(grid[row, col])
            ax.imshow(maps[col, 0], cmap="gray", vmin=-3, vmax=3, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(name, fontsize=8)
    spectrum_ax = fig.add_subplot(grid[:4, SHOWN + 1])
    means_ax = fig.add_subplot(grid[5:, SHOWN + 1])
    for index, (name, maps) in enumerate(samples.items()):
        flat = maps.reshape(-1, *maps.shape[-2:])
        freq, power = radial_power_spectrum(flat)
        style = "--" if index == len(samples) - 1 else "-"
        spectrum_ax.loglog(freq, power, style, label=name)
        means_ax.hist(flat.mean(axis=(-2, -1)), bins=60, histtype="step", linestyle=style, label=name)
    spectrum_ax.set_title("radially averaged power spectrum (unit-variance white noise = 1); it 10 equals it 6:\n"
                          "at 64 px the 6th level (r**5 > 32) is already 1x1", fontsize=9)
    spectrum_ax.set_xlabel("spatial frequency (cycles per 64-px latent)")
    spectrum_ax.set_ylabel("power")
    spectrum_ax.legend(fontsize=7)
    means_ax.set_title("per-map mean (the DC term that offset noise adds)", fontsize=9)
    means_ax.set_xlabel("mean over H, W of one channel")
    means_ax.set_ylabel("maps")
    fig.suptitle(f"training noise for {LATENT_SHAPE[1]}x{LATENT_SHAPE[2]}x{LATENT_SHAPE[3]} latents "
                 f"({LATENT_SHAPE[0]} samples per setting); pyramid levels stop at 1x1", fontsize=11)
    return fig


def main() -> None:
    torch.set_num_threads(1)
    latents = torch.zeros(LATENT_SHAPE)
    samples = {}
    for name, cfg in SETTINGS:
        samples[name] = sample_noise(latents, cfg, torch.Generator().manual_seed(0)).numpy()
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    draw(samples).savefig(OUTPUT)
    print(f"wrote {OUTPUT}")


if __name__ == "__main__":
    main()
