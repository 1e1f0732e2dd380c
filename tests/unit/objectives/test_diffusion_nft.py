"""DiffusionNFT (diffalign/objectives/diffusion_nft.py, docs/methods/diffusion_nft.md): the loss against values worked
out by hand from the paper's equations, the reward normalisation, what β does to the gradient, the config checks, the
plan, the old policy's soft update, and short runs of the method through the online loop."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_cfg, run_cli_in_process
from diffusers import FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file

from diffalign.advantages import group_advantages
from diffalign.config.validation import construct, validate_train_config
from diffalign.methods import ONLINE_FLOWS, ONLINE_MEMBERS, OnlineEpoch, check_method
from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.objectives.diffusion_nft import (
    DiffusionNFT,
    SoftUpdateOldPolicy,
    branch_loss,
    implicit_policies,
    nft_loss,
    old_policy_decay,
    optimality_probability,
    training_schedule,
)
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.types import PromptEmbeds, Trajectory

# ------------------------------------------------------------------------------------------------ hand-built values

# two samples of shape (1, 1, 2): rows are [v_theta, v_old, v (target)], worked out in docs/methods/diffusion_nft.md
# style
V_THETA = torch.tensor([[2.0, 0.0], [1.0, 3.0]]).reshape(2, 1, 1, 2)
V_OLD = torch.tensor([[0.0, 0.0], [1.0, 1.0]]).reshape(2, 1, 1, 2)
TARGET = torch.tensor([[1.0, 1.0], [0.0, 2.0]]).reshape(2, 1, 1, 2)
SIGMA = torch.tensor([0.5, 0.2]).reshape(2, 1, 1, 1)
R = torch.tensor([0.75, 0.0])
BETA = 0.5


def test_implicit_policies_are_the_papers_mixtures():
    v_plus, v_minus = implicit_policies(V_THETA, V_OLD, BETA)
    # v+ = (1 − β) v_old + β v_θ, v− = (1 + β) v_old − β v_θ
    torch.testing.assert_close(v_plus.flatten(1), torch.tensor([[1.0, 0.0], [1.0, 2.0]]))
    torch.testing.assert_close(v_minus.flatten(1), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
    torch.testing.assert_close((v_plus + v_minus) / 2, V_OLD)  # the two implicit policies straddle v_old


def test_uniform_loss_matches_the_hand_computed_value():
    # row 0: v+ − v = [0, −1] → ℓ+ = 0.5; v− − v = [−2, −1] → ℓ− = 2.5; L = 0.75·0.5 + 0.25·2.5 = 1.0
    # row 1: v+ − v = [1, 0] → ℓ+ = 0.5; v− − v = [1, −2] → ℓ− = 2.5; r = 0: L = 2.5
    loss = nft_loss(V_THETA, V_OLD, TARGET, SIGMA, R, BETA, "uniform")
    torch.testing.assert_close(loss, torch.tensor([1.0, 2.5]))


def test_adaptive_loss_matches_the_hand_computed_value():
    # x̂0 − x0 = −σ (v± − v); ℓ = mean(err²) / mean|err|
    # row 0 (σ 0.5): err+ = [0, 0.5] → 0.125 / 0.25 = 0.5; err− = [1, 0.5] → 0.625 / 0.75 = 5/6; L = 0.375 + 5/24
    # row 1 (σ 0.2): err+ = [−0.2, 0] → 0.02 / 0.1 = 0.2; err− = [−0.2, 0.4] → 0.1 / 0.3 = 1/3; r = 0: L = 1/3
    loss = nft_loss(V_THETA, V_OLD, TARGET, SIGMA, R, BETA, "adaptive")
    torch.testing.assert_close(loss, torch.tensor([0.375 + 5 / 24, 1 / 3]))
    # the weight is the released code's, computed from x_t and x_0: x̂0 = x_t − σ v±, x0 = x_t − σ v
    x0, noise = torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2)
    x_t, v = (1 - SIGMA) * x0 + SIGMA * noise, noise - x0
    x0_hat = x_t - SIGMA * V_THETA
    expected = ((x0_hat - x0) ** 2 / (x0_hat - x0).abs().mean(dim=(1, 2, 3), keepdim=True)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(branch_loss(V_THETA, v, SIGMA, "adaptive"), expected)


def test_optimality_probability_from_group_normalised_rewards():
    # r = ½ + ½ clip(A / A_max, −1, 1)
    a = torch.tensor([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 9.0])
    torch.testing.assert_close(optimality_probability(a, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0]))
    # the loop's advantages as the released config makes them (group mean, global population std + 1e-4, clip 5):
    # groups [1, 3] and [2, 2]; global std of [1, 3, 2, 2] = sqrt(0.5); A = ±1 / (sqrt(0.5) + 1e-4), 0, 0
    rewards, ids = torch.tensor([1.0, 3.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    adv, _ = group_advantages(rewards, ids, std="global", eps=1e-4, clip=5.0, correction=0)
    a1 = 1 / (0.5 ** 0.5 + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-a1, a1, 0.0, 0.0]))
    torch.testing.assert_close(optimality_probability(adv, 5.0),
                               torch.tensor([0.5 - a1 / 10, 0.5 + a1 / 10, 0.5, 0.5]))


# ------------------------------------------------------------------------------------------------ what β does


def _grad(v_theta, v_old, target, r, beta, weighting="uniform"):
    v_theta = v_theta.clone().requires_grad_(True)
    (nft_loss(v_theta, v_old, target, SIGMA[: len(r)], r, beta, weighting).sum() / beta).backward()
    return v_theta.grad


def test_gradient_of_the_loss_over_beta_is_the_hand_derived_one():
    # with d = v_θ − v_old and e = v_old − v: L = ‖e‖² + β²‖d‖² + 2β(2r − 1)⟨e, d⟩ (means over the D entries), so
    # ∇(L / β) = (2 / D) [β d + (2r − 1) e]
    g = torch.Generator().manual_seed(0)
    v_theta, v_old, target = (torch.randn(2, 3, 2, 2, generator=g) for _ in range(3))
    r = torch.tensor([0.9, 0.2])
    for beta in (0.1, 1.0, 3.0):
        expected = 2 / 12 * (beta * (v_theta - v_old) + (2 * r - 1).view(2, 1, 1, 1) * (v_old - target))
        torch.testing.assert_close(_grad(v_theta, v_old, target, r, beta), expected)


@pytest.mark.parametrize("weighting", ["uniform", "adaptive"])
def test_at_the_old_policy_the_gradient_is_the_signed_flow_matching_gradient_whatever_beta(weighting):
    # θ = θ_old: ∇(L / β) = (2r − 1) ∇ℓ(v_θ): the positives are fitted, the negatives pushed away, r = ½ ignored
    g = torch.Generator().manual_seed(1)
    v_old, target = torch.randn(2, 3, 2, 2, generator=g), torch.randn(2, 3, 2, 2, generator=g)
    r = torch.tensor([0.8, 0.3])
    v = v_old.clone().requires_grad_(True)
    branch_loss(v, target, SIGMA, weighting).sum().backward()
    fm_grad = v.grad
    for beta in (0.01, 1.0, 10.0):
        torch.testing.assert_close(_grad(v_old, v_old, target, r, beta, weighting),
                                   (2 * r - 1).view(2, 1, 1, 1) * fm_grad)
    assert _grad(v_old, v_old, target, torch.tensor([0.5, 0.5]), 1.0, weighting).abs().max() == 0


def test_beta_to_zero_freezes_the_gradient_at_the_old_policy_and_beta_one_with_r_one_is_flow_matching():
    g = torch.Generator().manual_seed(2)
    v_theta, v_old, target = (torch.randn(2, 3, 2, 2, generator=g) for _ in range(3))
    r = torch.tensor([1.0, 0.1])
    # β → 0: ∇(L / β) → (2 / D)(2r − 1)(v_old − v) wherever v_θ is (a first-order, reward-signed fit at v_old)
    limit = 2 / 12 * (2 * r - 1).view(2, 1, 1, 1) * (v_old - target)
    torch.testing.assert_close(_grad(v_theta, v_old, target, r, 1e-6), limit, rtol=1e-4, atol=1e-5)
    # β = 1, r = 1: v+ = v_θ, so L = ‖v_θ − v‖², plain flow matching on the positive samples (rejection fine-tuning)
    ones = torch.ones(2)
    torch.testing.assert_close(nft_loss(v_theta, v_old, target, SIGMA, ones, 1.0, "uniform"),
                               (v_theta - target).square().mean(dim=(1, 2, 3)))


def test_the_minimiser_is_the_old_policy_plus_two_over_beta_times_the_improvement_direction():
    # the policy-optimisation theorem: v* = v_old + (2 / β) Δ with Δ = α (v+ − v_old) = E[r (v − v_old) | x_t]. For N samples sharing x_t
    # whose targets average to v_old (v_old is then the exact conditional mean), the mean loss is minimised there.
    g = torch.Generator().manual_seed(3)
    targets = torch.randn(6, 1, 2, 2, generator=g)
    v_old = targets.mean(dim=0, keepdim=True).expand_as(targets)
    r = torch.rand(6, generator=g)
    for beta in (0.5, 2.0):
        delta = (r.view(6, 1, 1, 1) * (targets - v_old)).mean(dim=0, keepdim=True)
        v_star = (v_old + 2 / beta * delta).clone().requires_grad_(True)
        nft_loss(v_star, v_old, targets, SIGMA[:1].expand(6, 1, 1, 1), r, beta, "uniform").mean().backward()
        assert v_star.grad.sum(dim=0).abs().max() < 1e-6  # the shared v_θ(x_t) sees the sum of the rows' gradients


# ------------------------------------------------------------------------------------------------ config and contract


def test_diffusion_nft_declares_the_online_contract():
    check_method(DiffusionNFT(), "DiffusionNFT", ONLINE_FLOWS, ONLINE_MEMBERS, "online")
    assert DiffusionNFT.data_flow == "online_groups" and DiffusionNFT.advantage == "group"
    assert DiffusionNFT().epoch_updates(2, 3) == 6
    assert DiffusionNFT().checkpoint_states() == {"old_policy_state": None}  # v_old is made by setup(policy)


@pytest.mark.parametrize("kwargs,field", [
    ({"beta": 0.0}, "method.beta"), ({"beta_kl": -1.0}, "method.beta_kl"), ({"advantage_max": 0.0},
                                                                             "method.advantage_max"),
    ({"loss_weighting": "x0"}, "method.loss_weighting"), ({"timestep_fraction": 0.0}, "method.timestep_fraction"),
    ({"timestep_fraction": 1.5}, "method.timestep_fraction"), ({"old_policy_decay_max": 1.0},
                                                                "method.old_policy_decay_max"),
    ({"old_policy_decay_rate": -0.1}, "method.old_policy_decay_rate"),
    ({"old_policy_flat_steps": -1}, "method.old_policy_flat_steps"),
])
def test_bad_method_fields_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffusionNFT(**kwargs)


@pytest.mark.parametrize("overrides,field", [
    (["sampler.guidance_scale=4.5"], "sampler.guidance_scale"),
    (["online.best_of_n=4"], "online.best_of_n"),
    (["online.advantage_clip=2.0"], "online.advantage_clip"),
    (["method.beta=-1"], "method.beta"),
])
def test_bad_run_configs_fail_before_any_model_loads(overrides, field, tmp_path):
    cfg = compose_cfg(["recipe=tiny_diffusion_nft", f"output_dir={tmp_path}"] + overrides)
    with pytest.raises(ValueError, match=field):  # the config checks, then the method's constructor (build_run's first
        validate_train_config(cfg)                  # step, before any model loads)
        construct(cfg.method, "method")


def test_recipes_validate_and_the_paper_recipe_carries_the_released_settings(tmp_path):
    validate_train_config(compose_cfg(["recipe=tiny_diffusion_nft", f"output_dir={tmp_path}"]))
    for sampler in ("euler_ode", "flow_sde"):  # any solver: the loss never reads log-probs
        validate_train_config(compose_cfg(["recipe=tiny_diffusion_nft", f"sampler={sampler}",
                                           "sampler.guidance_scale=1.0", f"output_dir={tmp_path}"]))
    cfg = compose_cfg(["recipe=diffusion_nft_sd35_geneval", f"output_dir={tmp_path}"])
    m, on = cfg.method, cfg.online
    assert (m.beta, m.beta_kl, m.advantage_max, m.timestep_fraction) == (1.0, 1e-4, 5.0, 0.99)
    assert (m.old_policy_decay_max, m.old_policy_decay_rate, m.old_policy_flat_steps) == (0.5, 0.001, 0)
    assert (on.group_size, on.groups_per_epoch, on.advantage_std, on.updates_per_epoch) == (24, 48, "global", 1)
    assert (cfg.sampler.guidance_scale, cfg.sampler.num_inference_steps, cfg.trainer.optimizer.lr) == (1.0, 10, 3e-4)
    with pytest.raises(ValueError, match="online.prompts is required"):
        validate_train_config(cfg)


def test_an_eps_model_is_refused_before_it_loads(tmp_path, monkeypatch):
    """The flow-only check is the method's `check_config`: validation and the loop refuse an eps model before it is
    built (building it here would fail the test)."""
    from diffalign.models import tiny_random

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the method refused it")

    monkeypatch.setattr(tiny_random, "build_tiny_random_pipeline", no_build)
    cfg = compose_cfg(["recipe=tiny_diffusion_nft", "model=tiny_random", f"output_dir={tmp_path}",
                       "trainer.log_with=none"])
    with pytest.raises(ValueError, match="rectified-flow"):
        validate_train_config(cfg)
    from diffalign.train.online import train

    with pytest.raises(ValueError, match="rectified-flow"):
        train(cfg)


# ------------------------------------------------------------------------------------------------ plan and old policy


def _epoch(n=8, group_size=4, steps=10, batch_size=4, updates=2, inner=1) -> OnlineEpoch:
    traj = Trajectory(latents=torch.randn(n, steps + 1, 2, 4, 4), timesteps=torch.linspace(1000, 100, steps),
                      log_probs=torch.zeros(n, steps), trainable=torch.zeros(steps, dtype=torch.bool),
                      prompt_embeds=PromptEmbeds(torch.randn(n, 3, 8)), images=None,
                      prompts=[f"p{i // group_size}" for i in range(n)], guidance_scale=1.0, noise=0.0)
    return OnlineEpoch(traj, torch.randn(n), torch.arange(n) // group_size, group_size, torch.ones(1), seed=0,
                       epoch=0, batch_size=batch_size, updates=updates, inner_epochs=inner, num_processes=1,
                       split="groups", note=print)


class _CountingOldPolicy:
    def __init__(self):
        self.soft_updates = 0

    def soft_update(self):
        self.soft_updates += 1


class _SchedulerOnly:  # what `plan` reads of a policy
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)


def test_training_timesteps_are_the_models_own_schedule_whatever_the_solver():
    # the released code trains on pipeline.scheduler.timesteps (SD3's Euler schedule, shift 3), 10 steps: σ_0 = 1
    # (diffusers' FlowMatchEulerDiscreteScheduler.set_timesteps(10) of the SD3 pipeline); diffusers' flow DPM-Solver
    # would give 999 … 249 instead
    schedule = training_schedule(_SchedulerOnly(), 10)
    released = [1000.0, 960.1293, 913.3490, 857.6923, 790.3683, 707.2785, 602.1506, 464.8760, 278.0488, 8.9286]
    torch.testing.assert_close(schedule, torch.tensor(released), rtol=0, atol=1e-3)


def test_plan_trains_each_sample_on_its_own_timesteps_and_soft_updates_after_the_last_update():
    method = _with_counter(DiffusionNFT(timestep_fraction=0.5))
    epoch = _epoch(inner=2)
    updates = []
    for update in method.plan(_SchedulerOnly(), epoch):
        assert method.rollout_policy.soft_updates == 0  # v_old stays fixed during the epoch
        updates.append(update)
    assert method.rollout_policy.soft_updates == 1
    assert len(updates) == 4  # 2 updates × 2 inner epochs
    units = [u for update in updates for u in update]
    assert len(units) == 2 * 2 * 5  # inner epochs × minibatches of 4 × 5 of the 10 timesteps
    first = [u for u in units if u.inner == 0]
    assert sorted(torch.cat([u.rows for u in first if u.slot == 0]).tolist()) == list(range(8))  # every row once
    schedule = training_schedule(_SchedulerOnly(), 10).tolist()
    per_row = {}
    for u in first:
        for row, t in zip(u.rows.tolist(), u.timesteps.tolist()):
            per_row.setdefault(row, []).append(t)
    assert all(len(set(ts)) == 5 and set(ts) <= set(schedule) for ts in per_row.values())  # 5 distinct each
    assert len({tuple(sorted(ts)) for ts in per_row.values()}) > 1  # drawn per sample, not shared
    again = [u.timesteps.tolist() for update in _with_counter(DiffusionNFT(timestep_fraction=0.5)).plan(
        _SchedulerOnly(), epoch) for u in update]
    assert again == [u.timesteps.tolist() for u in units]  # seeded from (seed, epoch, group, member, inner)


def _with_counter(method):
    method.rollout_policy = _CountingOldPolicy()
    return method


def test_old_policy_decay_follows_the_released_schedules():
    # decay_type 1 (GenEval): flat 0, rate 0.001, max 0.5; decay_type 2 (OCR): flat 75, rate 0.0075, max 0.999
    assert [old_policy_decay(s, 0.5, 0.001, 0) for s in (0, 100, 600)] == [0.0, 0.1, 0.5]
    assert [old_policy_decay(s, 0.999, 0.0075, 75) for s in (50, 75, 175, 300)] == [0.0, 0.0, 0.75, 0.999]


def test_soft_update_moves_the_old_adapter_towards_the_policy_and_round_trips():
    policy = build_tiny_flow_policy(seed=0)
    old = SoftUpdateOldPolicy(decay_max=0.5, decay_rate=0.1, flat_steps=0)
    old.setup(policy)
    start = {k: p.detach().clone() for k, p in old.adapter.params.items()}
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1)
    for _ in range(3):
        old.after_update()
    assert old.soft_update() == pytest.approx(0.3)  # η = 0.1 · 3
    for k, p in old.adapter.params.items():
        torch.testing.assert_close(p, 0.3 * start[k] + 0.7 * old.adapter.policy_params[k].detach())
    state = old.state_dict()
    other = SoftUpdateOldPolicy()
    other.setup(build_tiny_flow_policy(seed=0))
    other.load_state_dict(state)
    assert other.step == 3
    for k, p in other.adapter.params.items():
        torch.testing.assert_close(p, old.adapter.params[k], rtol=0, atol=0)


def test_the_method_loss_is_the_scaled_paper_loss_plus_the_kl_to_the_base():
    torch.manual_seed(0)
    policy = build_tiny_flow_policy(seed=0)
    method = DiffusionNFT(beta=0.5, beta_kl=0.1)
    method.setup(policy)
    with torch.no_grad():  # θ away from v_old and from the base, so every term is non-trivial
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape))
    x0, noise = torch.randn(4, *policy.latent_shape), torch.randn(4, *policy.latent_shape)
    t = torch.tensor([900.0, 700.0, 400.0, 100.0])
    embeds = policy.encode_prompts(["a red circle"] * 4, do_classifier_free_guidance=False)
    adv = torch.tensor([2.0, -1.0, 0.0, 7.0])
    reference = FrozenBaseReference()
    loss, metrics = method(policy, x0, embeds, adv, timesteps=t, noise=noise, reference=reference)
    x_t, target = (1 - t.view(4, 1, 1, 1) / 1000) * x0 + t.view(4, 1, 1, 1) / 1000 * noise, noise - x0
    with torch.no_grad():
        v_theta = policy.predict(x_t, t, embeds)
        with method.rollout_policy.use(policy):
            v_old = policy.predict(x_t, t, embeds)
        with reference.use(policy):
            v_ref = policy.predict(x_t, t, embeds)
    r = torch.tensor([0.7, 0.4, 0.5, 1.0])
    paper = nft_loss(v_theta, v_old, target, t.view(4, 1, 1, 1) / 1000, r, 0.5, "adaptive")
    kl = (v_theta - v_ref).square().mean()
    torch.testing.assert_close(metrics["policy_loss"], 5.0 / 0.5 * paper.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.detach(), 10.0 * paper.mean() + 0.1 * kl, rtol=1e-5, atol=1e-6)
    assert metrics["old_deviation"] > 0 and metrics["kl"] > 0


# ------------------------------------------------------------------------------------------------ through the loop


def _overrides(tmp_path, epochs):
    return ["recipe=tiny_diffusion_nft", "model=tiny_flow_random", f"output_dir={tmp_path}",
            f"online.num_epochs={epochs}", "online.groups_per_epoch=2", "online.group_size=4",
            "online.checkpointing_epochs=1", "trainer.keep_last=-1", "trainer.batch_size=4", "trainer.log_with=none",
            "trainer.optimizer.lr=1e-2", "online.updates_per_epoch=2", "eval.enabled=false",
            "sampler.num_inference_steps=4"]


def test_resume_continues_exactly_with_the_old_policy_restored(tmp_path):
    from diffalign.train.online import train

    full = train(compose_cfg(_overrides(tmp_path / "full", 3)))
    train(compose_cfg(_overrides(tmp_path / "part", 2)))
    resumed = train(compose_cfg(_overrides(tmp_path / "part", 3) + ["resume=latest"]))
    assert resumed["global_step"] == full["global_step"] == 6
    a = load_file(tmp_path / "full" / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "part" / "final" / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    history = [json.loads(line) for line in (tmp_path / "part" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["old_deviation"] > 0  # two updates per epoch: θ leaves v_old inside the epoch


@pytest.mark.slow
def test_tiny_recipe_smoke_run_from_the_command_line(tmp_path, monkeypatch, capsys):
    from diffalign import cli

    out = tmp_path / "run"
    args = ["recipe=tiny_diffusion_nft", "online.num_epochs=1", "online.groups_per_epoch=2", "eval.enabled=false",
            "trainer.log_with=none", f"output_dir={out}"]
    done = run_cli_in_process(cli.train, args, tmp_path, monkeypatch, capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["rollouts"] == 16 and history[0]["step"] == 1
    assert torch.isfinite(torch.tensor(history[0]["loss"])) and 0 <= history[0]["nft/r_mean"] <= 1

