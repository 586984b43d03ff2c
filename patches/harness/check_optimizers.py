"""Checks on the patched upstream's own parser and get_optimizer (run by patches/check.sh in the patched tree).

Each name, in mixed case, builds our class on a bf16 parameter with the given --optimizer_args and takes a step; the
dotted path and a built-in name still work; unknown options fail clearly; --full_bf16 with plain AdamW (or an SR
optimizer with stochastic rounding turned off) logs the warning and the stochastic optimizers do not.
"""

from __future__ import annotations

import logging

import upstream_env  # noqa: F401  (first: torchvision stub, offline, one thread)

# isort: split

import torch  # noqa: E402

import train_network  # noqa: E402
from library import sr_optimizers, train_util  # noqa: E402

upstream_env.quiet_logging()

check = upstream_env.check


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


def parse(*argv: str):
    parser = train_network.setup_parser()
    return parser.parse_args(["--learning_rate", "1e-3", *argv])


def build(*argv: str, dtype=torch.bfloat16):
    args = parse(*argv)
    param = torch.nn.Parameter(torch.randn(8, 4).to(dtype))
    records = Records()
    logger = logging.getLogger(train_util.__name__)
    logger.addHandler(records)
    try:
        name, arg_text, optimizer = train_util.get_optimizer(args, [{"params": [param], "lr": 1e-3}])
    finally:
        logger.removeHandler(records)
    return name, arg_text, optimizer, param, records.messages


def step_moves(optimizer, param) -> bool:
    before = param.detach().clone()
    param.grad = torch.randn_like(param)
    optimizer.step()
    return param.dtype == torch.bfloat16 and not torch.equal(before, param.detach())


CASES = [
    ("sPaRkLeS", sr_optimizers.SPARKLES, ["betas=(0.9,0.99)", "centralization=0.5", "amp_fac=2",
                                          "stochastic_threshold=1e-6", "permutation_strategy='magnitude'"],
     {"betas": (0.9, 0.99), "amp_fac": 2, "permutation_strategy": "magnitude"}),
    ("compass", sr_optimizers.Compass, ["betas=0.95,0.999", "weight_decay=0.01"],
     {"betas": (0.95, 0.999), "weight_decay": 0.01}),
    ("STOCHASTICADAMW", sr_optimizers.StochasticAdamW, ["eps=1e-7", "weight_decay=1e-2"],
     {"eps": 1e-7, "weight_decay": 1e-2}),
    ("AdamWbf16", sr_optimizers.StochasticAdamW, [], {}),
]

for type_name, cls, option_items, expected in CASES:

    @check(f"--optimizer_type {type_name} {' '.join(option_items)}".rstrip())
    def _(type_name=type_name, cls=cls, option_items=option_items, expected=expected):
        argv = ["--optimizer_type", type_name]
        if option_items:
            argv += ["--optimizer_args", *option_items]
        name, _, optimizer, param, warnings = build(*argv, "--mixed_precision", "bf16", "--full_bf16")
        assert type(optimizer) is cls, f"built {type(optimizer)}"
        group = optimizer.param_groups[0]
        for key, value in expected.items():
            assert group[key] == value, f"{key}: {group[key]!r} != {value!r}"
        assert group["lr"] == 1e-3
        assert not warnings, f"unexpected warnings: {warnings}"
        assert step_moves(optimizer, param), "a step did not change the bf16 parameter"
        return name


@check("dotted path --optimizer_type library.sr_optimizers.compass.Compass")
def _():
    name, _, optimizer, param, _ = build("--optimizer_type", "library.sr_optimizers.compass.Compass",
                                         "--optimizer_args", "betas=(0.9,0.99)")
    assert type(optimizer) is sr_optimizers.Compass and optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert step_moves(optimizer, param)
    return name


@check("built-in names unchanged: AdamW, adamw -> torch.optim.AdamW")
def _():
    for type_name in ("AdamW", "adamw"):
        _, _, optimizer, _, _ = build("--optimizer_type", type_name)
        assert type(optimizer) is torch.optim.AdamW


@check("unknown option is refused with the accepted ones")
def _():
    try:
        build("--optimizer_type", "SPARKLES", "--optimizer_args", "bogus=1")
    except ValueError as error:
        assert "bogus" in str(error) and "takes" in str(error), error
        return str(error)[:100]
    raise AssertionError("no error for bogus=1")


@check("--full_bf16 with AdamW warns and names the SR optimizers")
def _():
    _, _, _, _, warnings = build("--optimizer_type", "AdamW", "--mixed_precision", "bf16", "--full_bf16")
    assert len(warnings) == 1, warnings
    for needle in ("--full_bf16", "StochasticAdamW", "Compass", "SPARKLES"):
        assert needle in warnings[0], f"{needle!r} not in {warnings[0]!r}"
    return warnings[0][:90] + "..."


@check("--full_bf16 with SPARKLES use_stochastic_rounding=False warns")
def _():
    _, _, _, _, warnings = build("--optimizer_type", "SPARKLES", "--optimizer_args", "use_stochastic_rounding=False",
                                 "--mixed_precision", "bf16", "--full_bf16")
    assert len(warnings) == 1, warnings


@check("no warning without --full_bf16")
def _():
    _, _, _, _, warnings = build("--optimizer_type", "AdamW", dtype=torch.float32)
    assert not warnings, warnings


upstream_env.finish("optimizer")
