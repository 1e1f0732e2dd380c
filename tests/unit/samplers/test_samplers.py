"""The sampler contract (diffalign/samplers/base.py) and the two samplers added on it: CPS (``sampler=cps_sde``) pinned
against a re-derivation of the ``cps`` branch of Flow-GRPO's released ``sde_step_with_logprob``, and MixGRPO's windowed
SDE (``sampler=window_sde``) against its released window schedule and the Euler ODE outside the window."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose_cfg, online_overrides

from diffalign.config.checks import ConfigError
from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.samplers.base import SAMPLERS, build_sampler
from diffalign.samplers.cps import CPSSampler, cps_step
from diffalign.samplers.flow_sde import gaussian_log_prob
from diffalign.samplers.rollout import recompute_log_probs, rollout
from diffalign.samplers.window_sde import WindowSDESampler, window_start

PROMPTS = ["a red circle", "a green triangle", "one yellow square"]


def released_cps(model_output, sigma, sigma_prev, sample, noise_level, variance_noise):
    """The ``sde_type == "cps"`` branch of Flow-GRPO's ``sde_step_with_logprob`` re-derived with its own operations
    (sigma, sigma_prev shaped to broadcast): (prev_sample, its released log-prob −mean((x' − μ)²), μ, std)."""
    std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
    pred_original_sample = sample - sigma * model_output
    noise_estimate = sample + model_output * (1 - sigma)
    mean = pred_original_sample * (1 - sigma_prev) + noise_estimate * torch.sqrt(sigma_prev**2 - std_dev_t**2)
    prev_sample = mean + std_dev_t * variance_noise
    log_prob = (-((prev_sample - mean) ** 2)).mean(dim=tuple(range(1, mean.ndim)))
    return prev_sample, log_prob, mean, std_dev_t


def test_cps_step_by_hand():
    # sigma 0.5 -> 0.25, a = 0.8: s = 0.25 sin(0.4 pi) = 0.2377641; x0 = 1 - 0.5 * 0.4 = 0.8, x1 = 1 + 0.5 * 0.4 = 1.2;
    # mu = 0.75 * 0.8 + 0.25 cos(0.4 pi) * 1.2 = 0.6 + 0.0772542 * 1.2 = 0.6927051
    x, v = torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 0.4)
    out = cps_step(v, 0.5, 0.25, x, noise_level=0.8, prev_sample=torch.full((1, 1, 1, 1), 0.6927051 + 0.1))
    assert out.mean.item() == pytest.approx(0.6927051, abs=1e-6) and float(out.std) == pytest.approx(0.2377641, abs=1e-6)
    expected = -0.01 / (2 * 0.2377641**2) - math.log(0.2377641) - 0.5 * math.log(2 * math.pi)
    assert out.log_prob.item() == pytest.approx(expected, abs=1e-5)
    # a = 0: the deterministic step, for a flow model the Euler step x + (sigma_next - sigma) v = 1 - 0.25 * 0.4
    euler = cps_step(v, 0.5, 0.25, x, noise_level=0.0)
    assert euler.prev_sample.item() == pytest.approx(0.9, abs=1e-6) and euler.log_prob.item() == 0
    with pytest.raises(ValueError, match="noise_level"):
        cps_step(v, 0.5, 0.25, x, noise_level=1.5)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        cps_step(v, 0.25, 0.5, x)


def test_cps_step_matches_the_released_step_on_a_real_schedule():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.float()
    torch.manual_seed(0)
    x, v = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    for k in range(9):  # (the last step ends at sigma 0: std 0, no log-prob)
        gen = torch.Generator().manual_seed(k)
        ours = cps_step(v, sigmas[k], sigmas[k + 1], x, noise_level=0.8, generator=gen)
        z = torch.randn(x.shape, generator=torch.Generator().manual_seed(k))  # the same draw
        prev, released_lp, mean, std = released_cps(v, sigmas[k], sigmas[k + 1], x, 0.8, z)
        torch.testing.assert_close(ours.mean, mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.prev_sample, prev, rtol=0, atol=1e-6)
        assert float(ours.std) == pytest.approx(float(std), rel=1e-6)
        # ours is the Gaussian log-density; the released score drops 1/(2 s^2) and the constants
        gaussian = released_lp / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        torch.testing.assert_close(ours.log_prob, gaussian, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.log_prob, gaussian_log_prob(prev, mean, std), rtol=1e-6, atol=1e-6)
    last = cps_step(v, sigmas[9], sigmas[10], x, noise_level=0.8)
    torch.testing.assert_close(last.prev_sample, x - sigmas[9] * v)  # x0-hat, no noise
    assert torch.equal(last.log_prob, torch.zeros(3))


def test_cps_rollout_stores_log_probs_that_recompute_to_ratio_one():
    policy = build_tiny_flow_policy(seed=0)
    gens = [torch.Generator().manual_seed(s) for s in range(3)]
    traj = rollout(policy, PROMPTS, CPSSampler(num_inference_steps=5, guidance_scale=4.5), generator=gens,
                   decode=False)
    assert traj.sampler == "cps_sde" and traj.noise == 0.8
    assert traj.trainable.tolist() == [True, True, True, True, False]  # sigma_K = 0: the last step has no noise
    with torch.no_grad():
        new = recompute_log_probs(policy, traj, range(5))
    torch.testing.assert_close(new, traj.log_probs, rtol=0, atol=1e-5)
    assert (traj.log_probs[:, :4] != 0).all() and (traj.log_probs[:, 4] == 0).all()


def released_window_starts(epochs: int, num_steps: int, iters_per_group: int = 25, stride: int = 1) -> list[int]:
    """``GRPOTrainingStates`` of MixGRPO's released code ("progressive", prog_overlap, roll_back, max_timesteps =
    K - 2): the window start of each of `epochs` iterations."""
    cur, in_group, starts = 0, 0, []
    for _ in range(epochs):
        starts.append(cur)
        in_group += 1
        if in_group >= iters_per_group:
            in_group, cur = 0, cur + stride
        if cur > num_steps - 2:
            cur, in_group = 0, 0
    return starts


def test_the_window_follows_mixgrpos_released_schedule():
    released = released_window_starts(25 * 30, 25)
    ours = [window_start(e, 25, shift_interval=25, window_stride=1) for e in range(25 * 30)]
    # the same until the released cycle reaches start K - 2 = 23, whose window [23, 23) is empty; ours skips it
    assert ours[:25 * 23] == released[:25 * 23] and released[25 * 23] == 23 and ours[25 * 23] == 0
    assert ours[25 * 23:25 * 30] == released[:25 * 7]
    assert sorted(set(ours)) == list(range(23))
    sampler = WindowSDESampler().at_epoch(25 * 5 + 3)  # (released defaults: 25 steps, window 4)
    assert (sampler.window_start, list(sampler.window)) == (5, [5, 6, 7, 8])
    assert list(WindowSDESampler(window_start=21).window) == [21, 22]  # clipped at K - 2


def test_window_sde_is_the_flow_sde_inside_the_window_and_the_euler_ode_outside():
    policy = build_tiny_flow_policy(seed=0)
    noise = torch.randn(3, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    sampler = WindowSDESampler(num_inference_steps=6, window_size=2, shift_interval=1).at_epoch(1)
    assert list(sampler.window) == [1, 2]

    def run(seed):
        gens = [torch.Generator().manual_seed(seed + s) for s in range(3)]
        return rollout(policy, PROMPTS, sampler, generator=gens, latents=noise.clone(), decode=False)

    a, b = run(0), run(10)
    assert a.sampler == "window_sde" and a.trainable.tolist() == [False, True, True, False, False, False]
    assert torch.equal(a.latents[:, :2], b.latents[:, :2])  # steps before the window are deterministic
    assert not torch.equal(a.latents[:, 2], b.latents[:, 2])  # the window draws noise
    # outside the window: x_{k+1} = x_k + (sigma_{k+1} - sigma_k) v, the flow Euler ODE step
    k, sigmas = 4, a.sigmas
    with torch.no_grad():
        v = policy.predict(a.latents[:, k], a.timesteps[k], a.prompt_embeds, 4.5)
    torch.testing.assert_close(a.latents[:, k + 1], a.latents[:, k] + (sigmas[k + 1] - sigmas[k]) * v, rtol=0,
                               atol=1e-5)
    with torch.no_grad():
        new = recompute_log_probs(policy, a, range(6))
    torch.testing.assert_close(new, a.log_probs, rtol=0, atol=1e-5)  # the window's log-probs, 0 elsewhere
    assert (a.log_probs[:, [1, 2]] != 0).all() and (a.log_probs[:, [0, 3, 4, 5]] == 0).all()


@pytest.mark.parametrize(("overrides", "match"), [
    ({"name": "cps_sde", "noise_level": 1.2}, r"sampler.noise_level must be a number in \[0, 1\], got 1.2"),
    ({"name": "window_sde", "num_inference_steps": 2}, r"sampler.num_inference_steps must be an integer >= 3"),
    ({"name": "window_sde", "window_start": 23}, r"sampler.window_start=23 must be <= num_inference_steps - 3"),
    ({"name": "window_sde", "window_size": 0}, r"sampler.window_size must be an integer >= 1, got 0"),
    ({"name": "flow_sde", "eta": 0.7}, r"sampler.eta is not a field of sampler=flow_sde"),
    ({"name": "ddim", "guidance_scale": 0.5}, r"sampler.guidance_scale must be a number >= 1, got 0.5"),
    ({"name": "sde"}, r"sampler.name='sde' must be one of \('flow_sde', "),
])
def test_bad_sampler_settings_are_one_line_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_sampler(overrides)


@pytest.mark.parametrize("name", ["cps_sde", "window_sde"])
def test_the_new_samplers_are_selected_from_the_command_line(name, tmp_path):
    from diffalign.config.validation import validate_train_config

    cfg = compose_cfg([f"output_dir={tmp_path}", "recipe=tiny_flow_grpo", f"sampler={name}"])
    sampler = build_sampler(cfg.sampler)
    assert type(sampler) is SAMPLERS[name] and sampler.name == name and sampler.stochastic
    validate_train_config(cfg)
    with pytest.raises(ValueError, match=f"sampler.model_family=flow, sampler={name}"):  # not for an eps model
        validate_train_config(compose_cfg([f"output_dir={tmp_path}", "model=tiny_random", "method=flow_grpo",
                                           f"sampler={name}"]))


@pytest.mark.parametrize("method", ["flow_grpo", "vipo"])
def test_every_sde_method_trains_only_the_window(method, tmp_path, monkeypatch):
    """Flow-GRPO and ViPO on the tiny flow model with sampler=window_sde: the trained transitions are the window's."""
    from diffalign.objectives import policy_gradient
    from diffalign.train.online import train

    trained = []
    plan = policy_gradient.transition_plan

    def spy(epoch, *args, **kwargs):
        for update in plan(epoch, *args, **kwargs):
            trained.append((epoch.epoch, sorted({unit.k for unit in update})))
            yield update

    monkeypatch.setattr(policy_gradient, "transition_plan", spy)
    if method == "vipo":
        from diffalign.objectives import vipo

        monkeypatch.setattr(vipo, "transition_plan", spy)
    cfg = compose_cfg([*online_overrides(tmp_path, epochs=2), "model=tiny_flow_random", f"method={method}",
                       "sampler=window_sde", "sampler.num_inference_steps=6", "sampler.window_size=2",
                       "sampler.shift_interval=1", "method.timestep_fraction=1.0"])
    train(cfg)
    # epoch 0: window [0, 2), epoch 1: [1, 3) (one step per epoch); each update trains only window steps
    assert {e for e, _ in trained} == {0, 1}
    assert all(set(ks) <= {0: {0, 1}, 1: {1, 2}}[e] for e, ks in trained)
    assert {k for e, ks in trained if e == 0 for k in ks} == {0, 1}
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2


@pytest.mark.parametrize("method", ["flow_grpo", "vipo"])
def test_every_sde_method_trains_cps_rollouts_but_never_their_last_step(method, tmp_path, monkeypatch):
    """Flow-GRPO and ViPO on the tiny flow model with sampler=cps_sde, 4 steps, every trainable step trained: CPS's
    last step lands on σ = 0 with std 0 and no log-prob, so each update trains steps {0, 1, 2} and never step 3; the
    first update of the run recomputes the stored log-probs (its consistency check would stop the run otherwise) and
    the LoRA moves."""
    from safetensors.torch import load_file

    from diffalign.objectives import policy_gradient
    from diffalign.train.online import train

    trained = []
    plan = policy_gradient.transition_plan

    def spy(epoch, *args, **kwargs):
        for update in plan(epoch, *args, **kwargs):
            trained.append(sorted({unit.k for unit in update}))
            yield update

    monkeypatch.setattr(policy_gradient, "transition_plan", spy)
    if method == "vipo":
        from diffalign.objectives import vipo

        monkeypatch.setattr(vipo, "transition_plan", spy)
    cfg = compose_cfg([*online_overrides(tmp_path, epochs=2), "model=tiny_flow_random", f"method={method}",
                       "sampler=cps_sde", "method.timestep_fraction=1.0"])
    train(cfg)
    assert trained and all(ks == [0, 1, 2] for ks in trained)
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    first = load_file(tmp_path / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    final = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(first[key], final[key]) for key in first)
