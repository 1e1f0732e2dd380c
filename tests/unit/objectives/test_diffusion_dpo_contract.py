"""Diffusion-DPO's edges and wiring that the loss tests (tests/unit/objectives/test_diffusion_dpo.py) leave open, found
by mutation testing (docs/contributing.md#mutation-testing): the metrics' names and values, the saturation boundary
and its counter, the argument checks with their messages, the released defaults, what the denoising target and the
reference strategy are given, and the noise's dtype for half-precision latents."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from diffusers import DDIMScheduler

from diffalign.objectives.diffusion_dpo import DiffusionDPO, DiffusionDPOConfig, diffusion_dpo_loss
from diffalign.runtime.console import console_summary
from diffalign.types import PreferenceBatch, PromptEmbeds


def test_every_metric_by_hand():
    """Two pairs, β = 10: z = −5 [(ℓθw − ℓrefw) − (ℓθl − ℓrefl)] = (1, −2)."""
    loss, metrics = diffusion_dpo_loss(torch.tensor([0.1, 0.5]), torch.tensor([0.3, 0.2]),
                                       torch.tensor([0.2, 0.4]), torch.tensor([0.2, 0.5]), beta=10.0)
    expected = {
        "loss": float(loss),
        "implicit_acc": 0.5,
        "rewards/chosen": (-5 * (0.1 - 0.2) + -5 * (0.5 - 0.4)) / 2,  # (0.5 − 0.5) / 2
        "rewards/rejected": (-5 * (0.3 - 0.2) + -5 * (0.2 - 0.5)) / 2,  # (−0.5 + 1.5) / 2
        "rewards/margins": (1 - 2) / 2,
        "model_loss/chosen": 0.3, "model_loss/rejected": 0.25, "ref_loss/chosen": 0.3, "ref_loss/rejected": 0.35,
        "saturated": 0.0,
    }
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-6), key
        assert metrics[key].shape == () and not metrics[key].requires_grad


def test_saturation_counts_strictly_above_30_under_its_kind(caplog):
    """z = 30 exactly (β = 2, ℓθw − ℓrefw = −30) is not counted; 30.5 is, under the kind "saturated" of a training
    loop's console summary, and logged at once outside one. z = −31 is not: −log σ(z) ≈ −z there, with gradient
    magnitude 1 − σ(31) (it was counted as |z| > 30, "~0 gradient")."""
    _, at = diffusion_dpo_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([30.0]), torch.tensor([0.0]),
                               beta=2.0)
    assert float(at["saturated"]) == 0.0
    w = torch.tensor([0.0], requires_grad=True)  # z = −(β/2)(ℓθw − ℓrefw) = −31
    below, metrics = diffusion_dpo_loss(w, torch.zeros(1), torch.tensor([-31.0]), torch.zeros(1), beta=2.0)
    (grad,) = torch.autograd.grad(below, [w])  # ∂(−log σ(z))/∂ℓθw = σ(−z) · β/2 = 1 − σ(−31)
    assert float(metrics["saturated"]) == 0.0 and float(grad) == pytest.approx(1.0, abs=1e-12)
    with console_summary() as counts:
        _, above = diffusion_dpo_loss(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([30.5, 0.0]),
                                      torch.zeros(2), beta=2.0)
        assert counts.pending() == {"saturated": 1}
    assert float(above["saturated"]) == 1.0
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.diffusion_dpo"):
        diffusion_dpo_loss(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([31.0]), torch.zeros(1), beta=2.0)
    assert ("Diffusion-DPO: 1 of 1 pairs had z > 30: already ranked right by a wide margin, ~0 gradient from them "
            "(logsigmoid flat); a few are expected, lower method.beta only if most are") in caplog.text


def test_loss_arguments_are_checked_with_the_shapes_in_the_message():
    one = torch.zeros(2)
    diffusion_dpo_loss(one, one, one, one, beta=0.5)  # any β > 0
    with pytest.raises(ValueError, match=r"beta=0.0 must be > 0 \(set method.beta, e.g. 5000"):
        diffusion_dpo_loss(one, one, one, one, beta=0.0)
    square = torch.zeros(2, 2)  # four of one shape, but not per-sample vectors
    message = (r"diffusion_dpo_loss expects four per-sample loss vectors of one shape \(B,\); got shapes "
               r"\[\(2, 2\), \(2, 2\), \(2, 2\), \(2, 2\)\]. Reduce each with per_sample_mse first.")
    with pytest.raises(ValueError, match=message):
        diffusion_dpo_loss(square, square, square, square, beta=1.0)
    with pytest.raises(ValueError, match=r"got shapes \[\(2,\), \(3,\), \(2,\), \(2,\)\]"):
        diffusion_dpo_loss(one, torch.zeros(3), one, one, beta=1.0)


def test_defaults_and_constructor_checks():
    method = DiffusionDPO()
    assert (method.beta, method.timestep_min, method.timestep_max) == (5000.0, 0, None)  # released SD1.5/SDXL
    config = DiffusionDPOConfig()
    assert (config.beta, config.timestep_min, config.timestep_max) == (5000.0, 0, None)
    assert DiffusionDPO(beta=0.5).beta == 0.5
    assert DiffusionDPO(timestep_min=3, timestep_max=3).timestep_max == 3  # a one-timestep range
    with pytest.raises(ValueError, match=r"method.timestep_min=-1 must be ≥ 0"):
        DiffusionDPO(timestep_min=-1)
    with pytest.raises(ValueError, match=r"method.timestep_max=1 is below method.timestep_min=2; set timestep_max ≥ "
                                         r"timestep_min, or null for the scheduler's last timestep."):
        DiffusionDPO(timestep_min=2, timestep_max=1)


class RecordingPolicy:
    """Latents of any shape; x_t = x_0 + ε, the prediction is θ·x_t (θ trainable; 1 in the reference) and the target is
    ε; records what `add_noise` and `training_target` were given."""

    def __init__(self):
        self.theta = torch.nn.Parameter(torch.tensor(1.5))
        self.scheduler = DDIMScheduler(num_train_timesteps=1000)
        self.in_reference, self.reference_scale, self.calls = False, 1.0, {}

    @contextlib.contextmanager
    def reference(self):
        self.in_reference = True
        try:
            yield self
        finally:
            self.in_reference = False

    def add_noise(self, latents, noise, timesteps):
        self.calls["add_noise"] = (latents, noise, timesteps)
        return latents + noise

    def training_target(self, latents, noise, timesteps):
        self.calls["training_target"] = (latents, noise, timesteps)
        return noise

    def predict(self, latents, timesteps, prompt_embeds, guidance_scale=1.0):
        return latents.float() * (self.reference_scale if self.in_reference else self.theta)


def pairs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return PreferenceBatch(torch.randn(2, 1, 2, 2, generator=gen).to(dtype),
                           torch.randn(2, 1, 2, 2, generator=gen).to(dtype), ["a", "b"],
                           PromptEmbeds(torch.zeros(2, 3, 4)))


def test_target_gets_both_halves_and_the_drawn_timesteps():
    policy = RecordingPolicy()
    batch = pairs()
    DiffusionDPO(beta=1.0)(policy, batch, generator=torch.Generator().manual_seed(1))
    latents, noise, timesteps = policy.calls["training_target"]
    assert torch.equal(latents, torch.cat([batch.latents_w, batch.latents_l]))
    assert timesteps is not None and torch.equal(timesteps, policy.calls["add_noise"][2])
    assert torch.equal(noise, policy.calls["add_noise"][1])


def test_half_precision_latents_get_noise_of_their_dtype():
    policy = RecordingPolicy()
    DiffusionDPO(beta=1.0)(policy, pairs(torch.bfloat16), generator=torch.Generator().manual_seed(1))
    assert policy.calls["add_noise"][1].dtype == torch.bfloat16


def test_a_reference_strategy_is_used_with_the_policy():
    """With a strategy (e.g. an EMA) its `use(policy)` runs the reference forward instead of `policy.reference()`:
    here a model predicting 2·x_t, so ℓref^w = mean((2 x_t − ε)²) over each winner's elements."""

    class Doubled:
        def __init__(self):
            self.seen = []

        @contextlib.contextmanager
        def use(self, policy):
            self.seen.append(policy)
            with policy.reference():
                policy.reference_scale = 2.0
                try:
                    yield policy
                finally:
                    policy.reference_scale = 1.0

    policy, strategy = RecordingPolicy(), Doubled()
    batch = pairs()
    _, metrics = DiffusionDPO(beta=1.0)(policy, batch, generator=torch.Generator().manual_seed(1), reference=strategy)
    assert strategy.seen == [policy]
    latents, noise, _ = policy.calls["add_noise"]
    x_t = latents + noise
    expected = ((2 * x_t[:2] - noise[:2]) ** 2).flatten(1).mean(1).mean()
    assert float(metrics["ref_loss/chosen"]) == pytest.approx(float(expected), rel=1e-6)


def test_shape_and_row_errors_name_the_shapes():
    policy = RecordingPolicy()
    batch = pairs()
    wrong = PreferenceBatch(batch.latents_w, batch.latents_l[:, :, :1], batch.prompts, batch.prompt_embeds)
    with pytest.raises(ValueError, match=r"batch.latents_w has shape \(2, 1, 2, 2\) but batch.latents_l has shape "
                                         r"\(2, 1, 1, 2\); winner and loser must be encoded at the same resolution."):
        DiffusionDPO()(policy, wrong)
    rows = PreferenceBatch(batch.latents_w, batch.latents_l, batch.prompts, PromptEmbeds(torch.zeros(3, 3, 4)))
    with pytest.raises(ValueError, match=r"batch.prompt_embeds has 3 rows for 2 pairs; pass one row per pair."):
        DiffusionDPO()(policy, rows)
