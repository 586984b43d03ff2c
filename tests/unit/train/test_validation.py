"""The validation loss: sd-scripts' fixed timesteps, the loss of one batch against a hand computation, the RNG left
alone, eval mode restored, the cadence and the tags."""

from __future__ import annotations

import pytest
import torch

from library.config import LossConfig, ModelConfig, NetworkConfig, NoiseConfig, PrecisionConfig, ValidationConfig
from library.families.model_setup import load_model
from library.families.precision import precision_policy
from library.families.registry import model_family
from library.train import validation as validation_module
from library.train.batch_loss import BatchLoss
from library.train.network_setup import build_network
from library.train.position import Position
from library.train.tracking import progress_fields
from library.train.validation import Validation, evaluating, validation_loss, validation_timesteps


def test_fixed_timesteps_are_sd_scripts_linspace():
    # np.linspace(min, max, 6, dtype=int)[1:-1], worked by hand: steps of (max - min) / 5, truncated
    assert validation_timesteps(None, None) == [200, 400, 600, 800]
    assert validation_timesteps(100, 900) == [260, 420, 580, 740]
    assert validation_timesteps(0, 999) == [199, 399, 599, 799]  # 199.8, 399.6, 599.4, 799.2
    assert validation_timesteps(None, None, num_train_timesteps=500) == [100, 200, 300, 400]


@pytest.fixture(scope="module")
def batch_loss():
    device = torch.device("cpu")
    policy = precision_policy(PrecisionConfig())
    model = load_model(ModelConfig(pretrained_model_name_or_path="builtin:tiny-sd15"), PrecisionConfig(), policy,
                       device, family=model_family("sd"))
    network, train_te = build_network(NetworkConfig(network_dim=4, network_alpha=4.0), model, policy, device,
                                      family=model_family("sd"))
    torch.manual_seed(0)
    for p in network.parameters():  # a LoRA that changes the outputs
        torch.nn.init.normal_(p, std=0.05)
    return BatchLoss(model, network, NoiseConfig(), LossConfig(), policy, device, torch.Generator().manual_seed(3),
                     None, None, train_te, model_family("sd"))


@pytest.fixture(scope="module")
def batches():
    gen = torch.Generator().manual_seed(11)
    return [{"latents": torch.randn(2, 4, 8, 8, generator=gen), "captions": ["a red circle", "a blue square"],
             "loss_weights": torch.ones(2)},
            {"latents": torch.randn(1, 4, 8, 8, generator=gen), "captions": ["a green triangle"],
             "loss_weights": torch.ones(1)}]


def hand_validation_loss(model, batches, seed: int) -> float:
    """sd-scripts' validation written out: torch.manual_seed(seed) (its ``switch_rng_state``), then
    ``enumerate(val_dataloader)`` (a torch DataLoader, whose new iterator takes its base seed from the global
    generator), then per batch and per timestep t in 200/400/600/800 one randn like the latents, DDPM add_noise at t
    (diffusers' scheduler), the UNet's epsilon prediction and the MSE against the noise; the mean over all (batch,
    timestep) pairs. The global generator's state is put back afterwards."""
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    loader = iter(torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False, num_workers=0))
    losses = []
    with torch.no_grad():
        for batch in loader:
            latents = batch["latents"] * model.vae.config.scaling_factor
            ids = model.tokenizer(batch["captions"], padding="max_length", max_length=77, truncation=True,
                                  return_tensors="pt").input_ids
            hidden = model.text_encoder(ids)[0]
            for t in (200, 400, 600, 800):
                noise = torch.randn_like(latents)
                steps = torch.full((latents.shape[0],), t)
                noisy = model.noise_scheduler.add_noise(latents, noise, steps)
                pred = model.unet(noisy, steps, hidden).sample
                losses.append(float(((pred - noise) ** 2).mean()))
    torch.set_rng_state(saved)
    return sum(losses) / len(losses)


def test_loss_of_batches_matches_a_hand_computation(batch_loss, batches):
    with torch.no_grad():
        ours = float(validation_loss(batch_loss, batches, [200, 400, 600, 800], seed=5))
    assert ours == pytest.approx(hand_validation_loss(batch_loss.model, batches, seed=5), rel=1e-5)
    with torch.no_grad():
        other_seed = float(validation_loss(batch_loss, batches, [200, 400, 600, 800], seed=6))
    assert other_seed != pytest.approx(ours, rel=1e-6)


def test_training_generators_are_left_alone(batch_loss, batches):
    global_state, train_state = torch.get_rng_state(), batch_loss.generator.get_state()
    with torch.no_grad():
        first = validation_loss(batch_loss, batches, [200, 400, 600, 800], seed=5)
        again = validation_loss(batch_loss, batches, [200, 400, 600, 800], seed=5)
    assert torch.equal(first, again)  # every validation draws the same noise
    assert torch.equal(torch.get_rng_state(), global_state)
    assert torch.equal(batch_loss.generator.get_state(), train_state)


def test_evaluating_restores_each_modules_mode_and_disables_gradients():
    net = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(2, 2))
    net.train()
    net[1].eval()
    with evaluating([net]):
        assert not any(m.training for m in net.modules())
        assert not torch.is_grad_enabled()
        assert torch.equal(net[0](torch.ones(4)), torch.ones(4))  # no dropout
    assert net.training and net[0].training and not net[1].training
    assert torch.is_grad_enabled()


class FakeData:
    seed = 9

    def __len__(self) -> int:
        return 3

    def fixed_batches(self, count: int, step: int):
        return [("batch", i, step) for i in range(min(count, 3))]


def cadence_run(monkeypatch, cfg: ValidationConfig) -> tuple[Validation, list]:
    calls = []

    def fake_loss(batch_loss, batches, timesteps, seed):
        calls.append((list(batches), timesteps, seed))
        return torch.tensor(0.75)

    monkeypatch.setattr(validation_module, "validation_loss", fake_loss)
    modules = (torch.nn.Linear(1, 1),)
    return Validation(FakeData(), None, modules, cfg, [200, 400, 600, 800], max_train_steps=10), calls


def test_step_cadence_tags_and_divergence(monkeypatch):
    val, calls = cadence_run(monkeypatch, ValidationConfig(validate_every_n_steps=2, max_validation_steps=2))
    logged = {step: val.at_step(Position(0, step), train_average=0.5) for step in range(1, 6)}
    assert [step for step, scalars in logged.items() if scalars] == [2, 4]
    assert logged[2] == {"loss/validation/step_average": 0.75, "loss/validation/step_divergence": 0.25}
    assert calls[0] == ([("batch", 0, 10), ("batch", 1, 10)], [200, 400, 600, 800], 9)
    assert val.last_loss == 0.75


def test_epoch_cadence_default_every_epoch_and_every_n(monkeypatch):
    val, _ = cadence_run(monkeypatch, ValidationConfig())
    assert val.at_step(Position(0, 4), 0.5) == {}  # no --validate_every_n_steps: never after an update
    assert val.at_epoch_end(Position(0, 4), 1.0) == {"loss/validation/epoch_average": 0.75,
                                                     "loss/validation/epoch_divergence": -0.25}
    val, calls = cadence_run(monkeypatch, ValidationConfig(validate_every_n_epochs=3))
    ran = [epoch + 1 for epoch in range(7) if val.at_epoch_end(Position(epoch, 0), 0.5)]
    assert ran == [3, 6] and len(calls) == 2 and len(calls[0][0]) == 3  # all batches by default


def test_progress_fields():
    # the bar's loss is the moving average (sd-scripts' avr_loss) and says so, with the steps it averages
    fields = progress_fields(2, 5, 0.123456, {"lr/textencoder": 5e-5, "lr/unet": 1e-4}, None, 15)
    assert fields == {"epoch": "2/5", "avg loss (last 15 steps)": "0.1235", "lr": "5e-05"}
    fields = progress_fields(1, 1, 0.5, {"lr/unet": 1.0, "lr/d*lr/unet": 2.5e-6}, 0.98765, 1)
    assert fields["avg loss (last 1 step)"] == "0.5000"
    assert fields["lr"] == "2.5e-06" and fields["val loss"] == "0.9877"
