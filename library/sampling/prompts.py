"""``--sample_prompts`` files and the sampling cadence, read and checked before anything loads.

The file forms are sd-scripts' (``library/train_util.py``: ``load_prompts``, ``line_to_prompt_dict``,
``sample_images_common``, ``sample_image_inference``):

* ``.txt``: one prompt per line; empty lines and lines whose first character is ``#`` are skipped (an indented
  ``#`` is part of a prompt, as in sd-scripts). Options follow the prompt, each introduced by `` --``:
  ``--n`` negative prompt, ``--w`` / ``--h`` width / height in pixels (default 512; rounded down to a multiple
  of 8, at least 64), ``--d`` seed (default: a fresh random seed each time), ``--l`` CFG scale (default 7.5; 1 or
  less turns guidance and the negative prompt off), ``--s`` steps (default 30, clamped to 1…1000), ``--ss``
  sampler (default ``--sample_sampler``). Option names are case-insensitive. ``--g`` (the embedded guidance of
  FLUX.1-dev, sd-scripts' ``guidance_scale``) and ``--fs`` (a flow shift above 0, sd-scripts' ``flow_shift``) are
  kept for the samplers that read them (``FamilySpec.sample_guidance`` / ``sample_flow_shift``; FLUX.1's, which
  reads ``--g``, also reads ``--s`` and ``--l`` with upstream FLUX's defaults 20 and 1.0 when the file leaves them
  out: ``SamplePrompt.options``). ``--g``, ``--fs``, ``--cn``, ``--ctr`` and ``--rcfg`` belong to some of sd-scripts'
  samplers; one that the family's samples ignore (SD 1.x/2.x and SDXL ignore them all, as sd-scripts'
  ``train_network.py`` does) gets a warning.
* ``.toml``: a ``[prompt]`` table of defaults and a ``[[prompt.subset]]`` list, one table per image, with the keys
  ``prompt``, ``negative_prompt``, ``width``, ``height``, ``seed``, ``sample_steps``, ``scale``,
  ``sample_sampler``, ``guidance_scale``, ``flow_shift`` (and the ignored ``controlnet_image``,
  ``cfg_trunc_ratio``, ``renorm_cfg``). A subset's key overrides the default (sd-scripts fails on such a repeat).
* ``.json``: a list whose items are such tables or ``.txt``-style lines.

Where we are stricter: sd-scripts skips an option it cannot read (an unknown ``--x``, ``--w 5l2``, ``--d -1``)
and falls back to DDIM for an unknown sampler; here each is an error naming the file, the line (or table) and
the option, raised before the data or the models are loaded. So is a value sd-scripts reads but that fails or
draws nothing at its first sample, after training steps ran (the ``MAX_*`` bounds below): ``--w`` / ``--h`` above
16384 pixels, a ``--d`` that does not fit a torch generator (above 2**64 - 1), a ``--l`` above 100 (where the
prediction overflows), a ``--fs`` that is no number above 0 and a prompt or negative prompt of more than 10000
characters (the pipeline reads 225 tokens of it). A ``<output_dir>/sample`` that is a file is found at the start
too (``check_sample_folder``).

Cadence (``sample_images_common``): at first (before the first update, also on resume) when ``--sample_at_first``;
after an update when ``global_step`` is a multiple of ``--sample_every_n_steps``; after epoch ``e`` when ``e`` is a
multiple of ``--sample_every_n_epochs``, which wins over the steps when both are given. A value of 0 or less turns
that cadence off (with a warning).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from library.base.errors import UserError, did_you_mean
from library.config import SampleConfig
from library.families.schedulers import SAMPLER_SPECS, missing_package
from library.text.weights import parse_prompt_attention

log = logging.getLogger(__name__)

DEFAULT_SIZE = 512
DEFAULT_STEPS = 30
DEFAULT_SCALE = 7.5
# Bounds of the options, checked when the file is read (sd-scripts reads any digits and fails at the first sample):
MAX_SIZE = 16384  # a width / height in pixels: ComfyUI's MAX_RESOLUTION; a VAE decode at 16384² needs > 100 GB
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes (a negative --d is no number to sd-scripts' regex)
MAX_STEPS = 1000  # sd-scripts clamps --s to 1...1000
MAX_SCALE = 100.0  # CFG: ComfyUI's KSampler maximum; far above it the prediction overflows to a NaN image
MAX_TEXT = 10_000  # characters of a prompt or negative prompt: the pipeline reads at most 225 tokens of it
_MAX_DIGITS = 30  # longer digit strings are out of every range (and int() refuses more than 4300 digits)


@dataclass(frozen=True)
class SamplePrompt:
    """One sample image: the ``index`` (0-based, in file order) names its file; sizes as written in the file;
    ``where`` is its line or table in the prompt file. ``guidance_scale`` (``--g``), ``flow_shift`` (``--fs``) and
    ``options`` (the table keys the file set, e.g. ``"sample_steps"``, ``"scale"``) are read by the samplers of the
    families that take them, whose defaults differ from this class's; they take no part in comparisons."""

    index: int
    prompt: str
    negative_prompt: str | None = None
    width: int = DEFAULT_SIZE
    height: int = DEFAULT_SIZE
    seed: int | None = None
    steps: int = DEFAULT_STEPS
    scale: float = DEFAULT_SCALE
    sampler: str | None = None
    where: str = field(default="", compare=False)
    guidance_scale: float | None = field(default=None, compare=False)
    flow_shift: float | None = field(default=None, compare=False)
    options: frozenset[str] = field(default=frozenset(), compare=False)

    def image_size(self) -> tuple[int, int]:
        """(width, height) drawn: rounded down to a multiple of 8, at least 64 (sd-scripts)."""
        return max(64, self.width - self.width % 8), max(64, self.height - self.height % 8)


@dataclass(frozen=True)
class SamplePlan:
    """What to draw and when; ``every_n_steps`` is None when ``every_n_epochs`` is set (epochs win)."""

    prompt_file: Path
    prompts: tuple[SamplePrompt, ...]
    sampler: str
    every_n_steps: int | None
    every_n_epochs: int | None
    at_first: bool


# option of a .txt line -> (table key, kind); kinds: text, size, seed, steps, scale, sampler, guidance, shift,
# ignored_*
_LINE_OPTIONS = {
    "n": ("negative_prompt", "text"),
    "w": ("width", "size"),
    "h": ("height", "size"),
    "d": ("seed", "seed"),
    "s": ("sample_steps", "steps"),
    "l": ("scale", "scale"),
    "ss": ("sample_sampler", "sampler"),
    "g": ("guidance_scale", "guidance"),
    "cn": ("controlnet_image", "ignored_text"),
    "ctr": ("cfg_trunc_ratio", "ignored_number"),
    "rcfg": ("renorm_cfg", "ignored_number"),
    "fs": ("flow_shift", "shift"),
}
_KEY_KINDS = {"prompt": "text", **dict(_LINE_OPTIONS.values())}
# the keys only some samplers read -> whose, in sd-scripts 48d368fa (its ``prompt_dict.get`` calls)
_IGNORED_BY = {"guidance_scale": "FLUX.1", "controlnet_image": "ControlNet", "cfg_trunc_ratio": "Lumina",
               "renorm_cfg": "Lumina", "flow_shift": "HunyuanImage / Anima"}
_OPTION_OF_KEY = {key: option for option, (key, _) in _LINE_OPTIONS.items()}
_DIGITS = re.compile(r"\d+")


class _Problems:
    """Collects every problem of a prompt file, each prefixed with its place, and the 'ignored' warnings."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors: list[str] = []
        self.ignored: dict[str, list[str]] = {}

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{self.path}:{where}: {message}")


def _shown(value: Any) -> str:
    """``repr`` of a value for a message, at most about 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


def _whole_number(kind: str, value: Any, label: str, where: str, problems: _Problems) -> int | None:
    """A width / height, seed or step count from a line option (digits) or a TOML/JSON integer, in its bounds."""
    text = value.strip() if isinstance(value, str) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        number = value
    elif text is not None and _DIGITS.fullmatch(text):
        number = int(text) if len(text.lstrip("0")) <= _MAX_DIGITS else 10**_MAX_DIGITS
    else:
        hint = {"size": "a width/height in pixels, e.g. 512", "seed": "a seed such as 42 (leave it out for "
                "a random seed)", "steps": "a number of steps, e.g. 28"}[kind]
        problems.error(where, f"{label} {_shown(value)}: expected a whole number >= 0: {hint}")
        return None
    if kind == "steps":
        return max(1, min(MAX_STEPS, number))
    shown = str(number) if text is None else text if len(text) <= 40 else f"{text[:40]}..."
    if kind == "size" and not 1 <= number <= MAX_SIZE:
        problems.error(where, f"{label} {shown}: expected a size of 1 to {MAX_SIZE} pixels, e.g. 512 (it is "
                       "rounded down to a multiple of 8, at least 64)")
        return None
    if kind == "seed" and number > MAX_SEED:
        problems.error(where, f"{label} {shown}: a seed must fit a torch generator: 0 to {MAX_SEED}")
        return None
    return number


def _convert(kind: str, value: Any, label: str, where: str, problems: _Problems) -> Any:
    """A value of the given kind from a line option (always a string) or a TOML/JSON value, within the option's
    bounds (``MAX_*``); None if bad."""
    if kind in ("text", "ignored_text"):
        if not isinstance(value, str):
            problems.error(where, f"{label}: expected text, got {value!r}")
            return None
        if kind == "text" and len(value) > MAX_TEXT:
            problems.error(where, f"{label}: {len(value)} characters, more than {MAX_TEXT}; the sample pipeline "
                           "reads at most 225 tokens of it: shorten it")
            return None
        return value
    if kind in ("size", "seed", "steps"):
        return _whole_number(kind, value, label, where, problems)
    if kind in ("scale", "guidance", "shift", "ignored_number"):
        try:
            number = float(value) if not isinstance(value, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if kind == "shift" and not (math.isfinite(number) and number > 0):
            problems.error(where, f"{label} {_shown(value)}: expected a flow shift above 0, e.g. 3.0")
            return None
        if not math.isfinite(number) or number < 0:
            problems.error(where, f"{label} {_shown(value)}: expected a number >= 0, e.g. 7.5")
            return None
        if kind == "scale" and number > MAX_SCALE:
            problems.error(where, f"{label} {_shown(value)}: expected a CFG scale of at most {MAX_SCALE:g}, e.g. "
                           "7.5")
            return None
        return number
    if not isinstance(value, str) or value.strip().lower() not in SAMPLER_SPECS:
        hint = did_you_mean(str(value)[:40], SAMPLER_SPECS)
        problems.error(where, f"{label} {_shown(value)}: unknown sampler{hint}; choose from "
                       f"{', '.join(SAMPLER_SPECS)}")
        return None
    return value.strip().lower()


def _prompt_from_table(index: int, table: dict[str, Any], where: str, problems: _Problems,
                       label_of=lambda key: f'key "{key}"') -> SamplePrompt | None:
    before = len(problems.errors)
    values: dict[str, Any] = {}
    for key, raw in table.items():
        kind = _KEY_KINDS.get(key)
        if kind is None:
            problems.error(where, f'unknown key "{key}"{did_you_mean(key, _KEY_KINDS)}; sample prompt keys: '
                           f"{', '.join(k for k, v in _KEY_KINDS.items() if not v.startswith('ignored'))}")
            continue
        value = _convert(kind, raw, label_of(key), where, problems)
        if kind.startswith("ignored") or kind in ("guidance", "shift"):
            problems.ignored.setdefault(key, []).append(where)
        if not kind.startswith("ignored") and value is not None:
            values[key] = value
    for key in ("prompt", "negative_prompt"):
        if isinstance(values.get(key), str):
            try:
                parse_prompt_attention(values[key])
            except UserError:
                problems.error(where, f"{label_of(key)} {values[key]!r}: a weight such as (word:1.2) is not a "
                               "number")
    if len(problems.errors) > before:
        return None
    return SamplePrompt(index=index, prompt=values.get("prompt", ""), negative_prompt=values.get("negative_prompt"),
                        width=values.get("width", DEFAULT_SIZE), height=values.get("height", DEFAULT_SIZE),
                        seed=values.get("seed"), steps=values.get("sample_steps", DEFAULT_STEPS),
                        scale=values.get("scale", DEFAULT_SCALE), sampler=values.get("sample_sampler"), where=where,
                        guidance_scale=values.get("guidance_scale"), flow_shift=values.get("flow_shift"),
                        options=frozenset(values))


def parse_prompt_line(index: int, line: str, where: str, problems: _Problems) -> SamplePrompt | None:
    """A ``.txt`` line (or a JSON string): the prompt up to the first `` --``, then one option per `` --``."""
    prompt, *options = line.split(" --")
    table: dict[str, Any] = {"prompt": prompt}
    for option in options:
        name, _, value = option.partition(" ")
        key_kind = _LINE_OPTIONS.get(name.lower())
        if key_kind is None:
            known = [f"--{o}" for o in _LINE_OPTIONS]
            problems.error(where, f"unknown option --{name}{did_you_mean('--' + name.lower(), known)}; sample "
                           "prompt options: --n --w --h --d --l --s --ss")
            continue
        if not value.strip():
            problems.error(where, f"--{name} needs a value")
            continue
        table[key_kind[0]] = value
    return _prompt_from_table(index, table, where, problems,
                              lambda key: "prompt" if key == "prompt" else f"--{_OPTION_OF_KEY[key]}")


def _read(path: Path, problems: _Problems) -> list[SamplePrompt | None]:
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".toml", ".json"):
        raise UserError(f"--sample_prompts {path}: use a .txt, .toml or .json prompt file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UserError(f"--sample_prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--sample_prompts {path}: cannot read it as UTF-8 text ({exc})") from None
    from library.base.bounded import load_json, load_toml

    source, fix = f"--sample_prompts {path}", "edit the file (a prompt file nests two or three levels deep)"
    if suffix == ".txt":
        lines = [(number, raw.strip()) for number, raw in enumerate(text.splitlines(), 1)
                 if raw.strip() and not raw.startswith("#")]
        return [parse_prompt_line(i, line, str(number), problems) for i, (number, line) in enumerate(lines)]
    if suffix == ".toml":
        import toml

        try:
            data = load_toml(text, source, fix, toml.loads, (toml.TomlDecodeError,))
        except toml.TomlDecodeError as exc:
            raise UserError(f"--sample_prompts {path}: not valid TOML ({exc})") from None
        defaults = data.get("prompt")
        subsets = defaults.get("subset") if isinstance(defaults, dict) else None
        if not isinstance(subsets, list) or not all(isinstance(s, dict) for s in subsets):
            raise UserError(f"--sample_prompts {path}: expected a [prompt] table of defaults and one "
                            "[[prompt.subset]] table per image")
        shared = {k: v for k, v in defaults.items() if k != "subset"}
        return [_prompt_from_table(i, {**shared, **subset}, f"prompt.subset[{i}]", problems)
                for i, subset in enumerate(subsets)]
    try:
        data = load_json(text, source, fix)
    except json.JSONDecodeError as exc:
        raise UserError(f"--sample_prompts {path}: not valid JSON ({exc})") from None
    if not isinstance(data, list):
        raise UserError(f"--sample_prompts {path}: expected a JSON list of prompt lines or tables")
    prompts = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            prompts.append(parse_prompt_line(i, item, f"[{i}]", problems))
        elif isinstance(item, dict):
            prompts.append(_prompt_from_table(i, item, f"[{i}]", problems))
        else:
            problems.error(f"[{i}]", f"expected a prompt line or a table, got {item!r}")
    return prompts


def load_prompt_file(path: str | Path, reads: Collection[str] = (),
                     samples: str = "the model's") -> list[SamplePrompt]:
    """Every prompt of a ``.txt`` / ``.toml`` / ``.json`` prompt file; all problems at once as a ``UserError``.
    Options only some samplers read (``_IGNORED_BY``) that the family's does not (``reads``: ``sampler_reads``)
    get one warning each, naming the family's samples (``samples``: its display name)."""
    problems = _Problems(Path(path))
    prompts = _read(problems.path, problems)
    if problems.errors:
        raise UserError(*problems.errors)
    for key, places in problems.ignored.items():
        if key not in reads:
            log.warning("%s:%s: --%s (%s) is for sd-scripts' %s samples; %s samples ignore it", problems.path,
                        ",".join(places), _OPTION_OF_KEY[key], key, _IGNORED_BY[key], samples)
    return [p for p in prompts if p is not None]


def check_sample_folder(plan: SamplePlan | None, output_dir: str | Path | None) -> None:
    """With sample images planned, ``<output_dir>/sample`` (where ``library/sampling/images.py`` writes them) must be
    a folder or not exist yet; a file there is a ``UserError`` at the start, not at the first sample."""
    if plan is None or output_dir is None:
        return
    folder = Path(output_dir) / "sample"  # library/sampling/images.py SAMPLE_FOLDER (that module imports torch)
    if os.path.lexists(folder) and not folder.is_dir():
        raise UserError(f"--sample_prompts {plan.prompt_file}: sample images go to {folder}, which is not a folder; "
                        "move or delete it, or choose another --output_dir")


def _cadence(name: str, value: int | None) -> int | None:
    if value is not None and value <= 0:
        log.warning("%s %d: 0 or less turns it off (as in sd-scripts)", name, value)
        return None
    return value


def sampler_reads(record: Any) -> frozenset[str]:
    """The keys only some samplers read (``_IGNORED_BY``) that a family's sampler reads, from its record
    (``FamilySpec.sample_guidance``, ``sample_flow_shift``)."""
    return frozenset(key for key, read in (("guidance_scale", record.sample_guidance),
                                           ("flow_shift", record.sample_flow_shift)) if read)


def plan_samples(cfg: SampleConfig, record: Any = None) -> SamplePlan | None:
    """When and what to sample, or None when no sample image will be drawn; bad prompt files raise ``UserError``.
    ``record``: the family's ``FamilySpec``, whose sampler's options are not warned about (None: warn about all)."""
    every_steps = _cadence("--sample_every_n_steps", cfg.sample_every_n_steps)
    every_epochs = _cadence("--sample_every_n_epochs", cfg.sample_every_n_epochs)
    if not (every_steps or every_epochs or cfg.sample_at_first):
        if cfg.sample_prompts:
            log.info("--sample_prompts %s: no --sample_every_n_steps, --sample_every_n_epochs or --sample_at_first, "
                     "so no sample images are drawn", cfg.sample_prompts)
        return None
    if not cfg.sample_prompts:
        given = [f"--{n}" for n, v in (("sample_every_n_steps", every_steps), ("sample_every_n_epochs", every_epochs),
                                       ("sample_at_first", cfg.sample_at_first)) if v]
        raise UserError(f"{' / '.join(given)} needs --sample_prompts FILE (.txt, .toml or .json) with the prompts "
                        "of the sample images")
    if every_steps and every_epochs:
        log.info("--sample_every_n_epochs %d wins over --sample_every_n_steps %d (as in sd-scripts)", every_epochs,
                 every_steps)
        every_steps = None
    path = Path(cfg.sample_prompts)
    prompts = load_prompt_file(path) if record is None else \
        load_prompt_file(path, sampler_reads(record), record.display_name)
    if not prompts:
        log.warning("--sample_prompts %s has no prompts: no sample images are drawn", path)
        return None
    sampler = cfg.sample_sampler.lower()
    missing = [f"{name}: the {SAMPLER_SPECS[name].scheduler} scheduler needs {package}; pip install {package}, "
               "or choose another sampler such as euler or ddim"
               for name in sorted({sampler, *(p.sampler for p in prompts if p.sampler)})
               if (package := missing_package(name))]
    too_few = [f"{path}:{p.where}: --s {p.steps}: the {name} sampler needs at least {SAMPLER_SPECS[name].min_steps} "
               "steps; use more steps or another sampler"
               for p in prompts if p.steps < SAMPLER_SPECS[name := p.sampler or sampler].min_steps]
    if missing or too_few:
        raise UserError(*(f"--sample_sampler / --ss {line}" for line in missing), *too_few)
    return SamplePlan(prompt_file=path, prompts=tuple(prompts), sampler=sampler, every_n_steps=every_steps,
                      every_n_epochs=every_epochs, at_first=cfg.sample_at_first)
