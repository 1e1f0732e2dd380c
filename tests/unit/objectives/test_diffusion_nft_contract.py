"""`DiffusionNFT`'s wiring, model-free, found by mutation testing (docs/contributing.md#mutation-testing): only the
resume and command-line tests, excluded as slow, ran `prepare`, `loss` and `training_noise`. The epoch's metrics by
hand, the unit's rows, timesteps and noise reaching the objective, the documented keys of the per-row streams, the
member ordinals, the field bounds (each edge value accepted) and every message in full."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from diffalign.methods import NOISE, TIMESTEPS, OnlineEpoch
from diffalign.objectives import diffusion_nft
from diffalign.objectives.diffusion_nft import (
    DiffusionNFT,
    DiffusionNFTConfig,
    SoftUpdateOldPolicy,
    member_ordinals,
    train_timesteps,
    training_noise,
)
from diffalign.types import PromptEmbeds, Trajectory


def _epoch(advantages, group_ids, group_size=4, seed=3, epoch=2, steps=4) -> OnlineEpoch:
    n = len(advantages)
    traj = Trajectory(latents=torch.randn(n, steps + 1, 2, 3, 3), timesteps=torch.linspace(1000, 250, steps),
                      log_probs=torch.zeros(n, steps), trainable=torch.zeros(steps, dtype=torch.bool),
                      prompt_embeds=PromptEmbeds(torch.arange(n * 6, dtype=torch.float32).reshape(n, 3, 2)),
                      images=None, prompts=[f"p{g}" for g in group_ids], guidance_scale=1.0, noise=0.0)
    return OnlineEpoch(traj, torch.tensor(advantages, dtype=torch.float32), torch.tensor(group_ids), group_size,
                       torch.ones(1), seed=seed, epoch=epoch, batch_size=2, updates=1, inner_epochs=1,
                       num_processes=1, split="groups", note=lambda message: None)


def _stream_seed(seed, epoch, group, member, stream) -> int:  # the documented key: SeedSequence([...]), 63 bits
    return int(np.random.SeedSequence([seed, epoch, group, member, stream]).generate_state(1, np.uint64)[0] >> 1)


class _OldPolicy:
    def __init__(self, decay):
        self._decay = decay

    def decay(self):
        return self._decay


def test_prepare_logs_the_mean_optimality_probability_the_positive_fraction_and_the_decay():
    """A = (−6, −1, 0, 2.5, 10) with A_max = 5: r = ½ + ½ clip(A/5, −1, 1) = (0, 0.4, 0.5, 0.75, 1); the mean is
    2.65 / 5 = 0.53 and 2 of 5 are strictly above ½ (the sample at its group's mean, r = ½, is not)."""
    method = DiffusionNFT()
    method.rollout_policy = _OldPolicy(0.25)
    metrics = method.prepare(None, _epoch([-6.0, -1.0, 0.0, 2.5, 10.0], [0, 0, 0, 1, 1]))
    assert metrics == pytest.approx({"nft/r_mean": 0.53, "nft/positive_fraction": 0.4, "nft/old_policy_decay": 0.25})
    method = DiffusionNFT(advantage_max=2.0)
    method.rollout_policy = _OldPolicy(0.0)
    assert method.prepare(None, _epoch([-1.0, 1.0], [0, 0]))["nft/r_mean"] == pytest.approx(0.5)  # (0.25 + 0.75) / 2


def test_member_ordinals_count_each_groups_rows_in_order():
    out = member_ordinals(torch.tensor([0, 0, 1, 0, 1, 2, 7]))
    assert out.tolist() == [0, 1, 0, 2, 1, 0, 0] and out.dtype == torch.long


def test_the_training_noise_and_timesteps_follow_their_documented_keys():
    """ε of row (group g, member m) at inner epoch i, slot j is ``torch.randn`` from a CPU generator seeded with
    ``SeedSequence([seed, epoch, g, (i·G + m)·1000 + j, NOISE])``; its timesteps are the first n of a ``randperm``
    seeded with slot 999 and stream TIMESTEPS (diffalign/objectives/diffusion_nft.py, `_row_seed`)."""
    epoch = _epoch([0.0] * 3, [5, 5, 9], group_size=4, seed=3, epoch=2)
    groups, members = torch.tensor([5, 9, 5]), torch.tensor([1, 0, 3])
    noise = training_noise((2, 3), epoch, groups, members, inner=1, slot=7)
    for row, (g, m) in enumerate([(5, 1), (9, 0), (5, 3)]):
        gen = torch.Generator().manual_seed(_stream_seed(3, 2, g, (1 * 4 + m) * 1000 + 7, NOISE))
        torch.testing.assert_close(noise[row], torch.randn((2, 3), generator=gen), rtol=0, atol=0)
    order = train_timesteps(epoch, torch.tensor([0, 1, 0]), 1, num_steps=6, n_train=4)
    for row, (g, m) in enumerate([(5, 0), (5, 1), (9, 0)]):
        gen = torch.Generator().manual_seed(_stream_seed(3, 2, g, (1 * 4 + m) * 1000 + 999, TIMESTEPS))
        assert order[row].tolist() == torch.randperm(6, generator=gen)[:4].tolist()


class _Recording(DiffusionNFT):
    """Records what `loss` passes to the objective."""

    def __call__(self, policy, x0, prompt_embeds, advantages, *, timesteps, noise, reference=None):
        self.got = {"policy": policy, "x0": x0, "prompt_embeds": prompt_embeds, "advantages": advantages,
                    "timesteps": timesteps, "noise": noise, "reference": reference}
        return torch.tensor(1.5), {}


def test_loss_passes_the_units_rows_timesteps_and_keyed_noise():
    epoch = _epoch([1.0, -2.0, 0.5, 3.0], [4, 4, 6, 6], group_size=2)
    method = _Recording()
    unit = diffusion_nft._NFTUnit(epoch, torch.tensor([3, 0]), torch.tensor([700.0, 300.0]), torch.tensor([1, 0]),
                                  inner=1, slot=2)
    policy, reference = object(), object()
    assert method.loss(policy, unit, reference=reference) == (torch.tensor(1.5), {})
    got = method.got
    assert got["policy"] is policy and got["reference"] is reference
    torch.testing.assert_close(got["x0"], epoch.trajectory.latents[[3, 0], -1], rtol=0, atol=0)
    torch.testing.assert_close(got["prompt_embeds"].prompt_embeds, epoch.trajectory.prompt_embeds.prompt_embeds[[3, 0]],
                               rtol=0, atol=0)
    assert got["advantages"].tolist() == [3.0, 1.0] and got["timesteps"].tolist() == [700.0, 300.0]
    for row, (g, m) in enumerate([(6, 1), (4, 0)]):
        gen = torch.Generator().manual_seed(_stream_seed(3, 2, g, (1 * 2 + m) * 1000 + 2, NOISE))
        torch.testing.assert_close(got["noise"][row], torch.randn((2, 3, 3), generator=gen), rtol=0, atol=0)


def test_plan_units_reach_loss_with_their_epoch_and_members(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler

    class SchedulerOnly:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    epoch = _epoch([1.0, -1.0, 2.0, -2.0], [0, 0, 1, 1], group_size=2)
    method = _Recording(timestep_fraction=0.1)  # ⌊4 · 0.1⌋ = 0 → at least one timestep per sample
    method.rollout_policy = _OldPolicy(0.0)
    method.rollout_policy.soft_update = lambda: None
    units = [u for update in method.plan(SchedulerOnly(), epoch) for u in update]
    assert {u.slot for u in units} == {0}
    for unit in units:
        assert unit.epoch is epoch
        assert unit.members.tolist() == member_ordinals(epoch.group_ids)[unit.rows].tolist()
        method.loss(None, unit, reference=None)


def test_every_bound_accepts_its_edge_and_the_config_object_is_used():
    DiffusionNFT(beta_kl=0.0, advantage_max=0.5, timestep_fraction=1.0, old_policy_decay_max=0.0,
                 old_policy_decay_rate=0.0, old_policy_flat_steps=0)
    config = DiffusionNFTConfig(beta=0.1, beta_kl=0.0, advantage_max=3.0, loss_weighting="uniform",
                                timestep_fraction=0.5, old_policy_decay_max=0.999, old_policy_decay_rate=0.0075,
                                old_policy_flat_steps=75)
    method = DiffusionNFT(config)
    assert (method.beta, method.beta_kl, method.advantage_max, method.loss_weighting, method.timestep_fraction,
            method.old_policy_decay_max, method.old_policy_decay_rate, method.old_policy_flat_steps) == (
        0.1, 0.0, 3.0, "uniform", 0.5, 0.999, 0.0075, 75)


def test_setup_builds_the_old_policy_with_the_methods_schedule(monkeypatch):
    monkeypatch.setattr(SoftUpdateOldPolicy, "setup", lambda self, policy: None)
    method = DiffusionNFT(old_policy_decay_max=0.999, old_policy_decay_rate=0.0075, old_policy_flat_steps=75)
    method.setup(None)
    old = method.rollout_policy
    assert (old.decay_max, old.decay_rate, old.flat_steps, old.step) == (0.999, 0.0075, 75, 0)
    default = SoftUpdateOldPolicy()  # the released decay_type 1 (GenEval): η_max 0.5, rate 0.001, flat 0
    assert (default.decay_max, default.decay_rate, default.flat_steps, default.adapter) == (0.5, 0.001, 0, None)


@pytest.mark.parametrize("fields,message", [
    ({"old_policy_decay_max": 1.0}, "method.old_policy_decay_max=1.0 must be in [0, 1) (0.5 GenEval)."),
    ({"beta_kl": -1.0}, "method.beta_kl=-1.0 must be >= 0 (1e-4 in the released config; 0 disables)."),
    ({"old_policy_decay_rate": -0.1}, "method.old_policy_decay_rate=-0.1 must be >= 0."),
])
def test_bad_fields_are_refused_with_the_whole_message(fields, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        DiffusionNFT(**fields)


def _run_cfg(**online):
    return OmegaConf.create({"model": {"_target_": "diffalign.models.tiny_flow.build_tiny_flow_policy"},
                             "sampler": {"guidance_scale": 1.0}, "online": {"best_of_n": None, **online},
                             "method": {"advantage_max": 5.0}})


def test_check_config_messages_in_full():
    DiffusionNFT.check_config(_run_cfg(advantage_clip=5.0))  # equal to A_max: r reaches 0 and 1
    with pytest.raises(ValueError, match="^" + re.escape(
            "online.best_of_n selects samples for the policy-gradient methods; DiffusionNFT trains on every sample "
            "of the old policy: set online.best_of_n=null") + "$"):
        DiffusionNFT.check_config(_run_cfg(best_of_n=4))
    with pytest.raises(ValueError, match="^" + re.escape(
            "online.advantage_clip=2.0 is below method.advantage_max=5.0: the optimality probability r = 1/2 + A / "
            "(2 A_max) could never reach 0 or 1. Set online.advantage_clip >= method.advantage_max (both 5 in the "
            "released config)") + "$"):
        DiffusionNFT.check_config(_run_cfg(advantage_clip=2.0))
    eps = _run_cfg()
    eps.model._target_ = "diffalign.models.tiny_random.build_tiny_random_policy"
    with pytest.raises(ValueError, match=r"is an eps/v-prediction model; use a flow model \(model=tiny_sd3, "
                                         r"model=sd35_medium\)$"):
        DiffusionNFT.check_config(eps)


class _SlopePolicy:
    """A flow policy whose velocity is v = a · x_t, a the slope of whichever weights are active (θ unless a `_Weights`
    block swapped them); x_t = (1 − σ) x_0 + σ ε, v = ε − x_0, σ = t / 1000. Records the timesteps of every call."""

    def __init__(self, a: float):
        self.a, self.calls = a, []

    def add_noise(self, x0, noise, t):
        self.calls.append(("add_noise", t))
        s = (t / 1000).reshape(-1, 1, 1, 1)
        return (1 - s) * x0 + s * noise

    def training_target(self, x0, noise, t):
        self.calls.append(("training_target", t))
        return noise - x0

    def sigmas_of(self, t, x_t):
        self.calls.append(("sigmas_of", t))
        return (t / 1000).reshape(-1, 1, 1, 1)

    def predict(self, x_t, t, prompt_embeds, guidance_scale=1.0):
        self.calls.append(("predict", t, self.a))
        return self.a * x_t


class _Weights:
    """v_old or the reference: `use(policy)` sets the slope of the policy it is given to `a` for the block."""

    def __init__(self, a: float):
        self.a = a

    def use(self, policy):
        import contextlib

        @contextlib.contextmanager
        def swapped():
            saved, policy.a = policy.a, self.a
            try:
                yield policy
            finally:
                policy.a = saved
        return swapped()


X0 = torch.tensor([[1.0, -2.0], [0.5, 0.0], [3.0, 1.0]]).reshape(1, 3, 1, 2).repeat(2, 1, 1, 1) * torch.tensor(
    [1.0, -0.5]).reshape(2, 1, 1, 1)  # (B, C, h, w) = (2, 3, 1, 2): C ≠ B
EPS = torch.tensor([[0.2, 0.4], [-1.0, 1.5], [0.0, -0.3]]).reshape(1, 3, 1, 2).repeat(2, 1, 1, 1)


def _paper_loss(t, adv, a_theta, a_old, a_ref, beta, beta_kl, advantage_max):
    """The uniform-weighted loss of the paper's policy-optimisation theorem by hand: x_t = (1 − σ) x_0 + σ ε, v = ε −
    x_0, v± = (1 ∓ β) v_old ± β v_θ, ℓ± = mean (v± − v)², r = ½ + ½ clip(A / A_max, −1, 1), scaled by A_max / β as
    the released code, plus β_KL · mean (v_θ − v_ref)²."""
    s = t.reshape(-1, 1, 1, 1) / 1000
    x_t = (1 - s) * X0 + s * EPS
    v, v_theta, v_old, v_ref = EPS - X0, a_theta * x_t, a_old * x_t, a_ref * x_t
    plus, minus = (1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta
    r = 0.5 + 0.5 * torch.clamp(adv / advantage_max, -1, 1)
    per_sample = r * (plus - v).square().mean(dim=(1, 2, 3)) + (1 - r) * (minus - v).square().mean(dim=(1, 2, 3))
    policy_loss = advantage_max / beta * per_sample.mean()
    kl = (v_theta - v_ref).square().mean()
    return policy_loss, kl, (v_theta - v_old).square().mean(), r.mean()


def test_call_by_hand_with_uniform_weighting_and_the_kl_term():
    """A = (3, −1), A_max = 2: r = (1, 0.25); β = 0.5, β_KL = 0.5 and slopes θ 1.2, v_old 1.0, reference 0.7 (each term
    non-trivial). The method's ``loss_weighting`` reaches the loss, the KL is added, every metric is the hand value, and
    each forward sees the rows' own timesteps."""
    policy = _SlopePolicy(1.2)
    method = DiffusionNFT(beta=0.5, beta_kl=0.5, advantage_max=2.0, loss_weighting="uniform")
    method.rollout_policy = _Weights(1.0)
    t, adv = torch.tensor([800.0, 250.0]), torch.tensor([3.0, -1.0])
    loss, metrics = method(policy, X0, None, adv, timesteps=t, noise=EPS, reference=_Weights(0.7))
    policy_loss, kl, old_deviation, r = _paper_loss(t, adv, 1.2, 1.0, 0.7, 0.5, 0.5, 2.0)
    assert set(metrics) == {"loss", "policy_loss", "kl", "old_deviation", "r"}
    torch.testing.assert_close(metrics["policy_loss"], policy_loss)
    torch.testing.assert_close(metrics["kl"], kl)
    torch.testing.assert_close(loss, policy_loss + 0.5 * kl)
    torch.testing.assert_close(metrics["loss"], loss)
    torch.testing.assert_close(metrics["old_deviation"], old_deviation)
    assert float(r) == 0.625  # (1 + 0.25) / 2
    torch.testing.assert_close(metrics["r"], r)
    assert sorted(call[2] for call in policy.calls if call[0] == "predict") == [0.7, 1.0, 1.2]
    for call in policy.calls:
        torch.testing.assert_close(call[1], t, rtol=0, atol=0)


def test_a_scalar_timestep_reaches_every_forward_as_one_per_row():
    """``timesteps`` may be one number (docstring): the policy is called with it expanded to the B rows, and the loss
    is that of the (B,) tensor of that value."""
    method = DiffusionNFT(beta=0.5, beta_kl=0.0, advantage_max=2.0, loss_weighting="uniform")
    method.rollout_policy = _Weights(1.0)
    policy = _SlopePolicy(1.2)
    loss, _ = method(policy, X0, None, torch.tensor([3.0, -1.0]), timesteps=400.0, noise=EPS)
    assert [tuple(call[1].shape) for call in policy.calls] == [(2,)] * 5
    for call in policy.calls:
        assert call[1].tolist() == [400.0, 400.0]
    policy_loss, *_ = _paper_loss(torch.full((2,), 400.0), torch.tensor([3.0, -1.0]), 1.2, 1.0, 1.0, 0.5, 0.0, 2.0)
    torch.testing.assert_close(loss, policy_loss)


def test_beta_kl_zero_needs_no_reference_and_a_positive_one_does():
    method = DiffusionNFT(beta=0.5, beta_kl=0.0, advantage_max=2.0, loss_weighting="uniform")
    method.rollout_policy = _Weights(1.0)
    policy = _SlopePolicy(1.2)
    loss, metrics = method(policy, X0, None, torch.tensor([3.0, -1.0]), timesteps=torch.tensor([800.0, 250.0]),
                           noise=EPS)
    assert float(metrics["kl"]) == 0.0 and metrics["kl"].shape == () and float(loss) == float(metrics["policy_loss"])
    assert [call[2] for call in policy.calls if call[0] == "predict"] == [1.0, 1.2]  # no reference forward
    method = DiffusionNFT(beta_kl=0.1)
    method.rollout_policy = _Weights(1.0)
    with pytest.raises(ValueError, match=r"^method\.beta_kl > 0 needs a reference; the loop passed none\.$"):
        method(_SlopePolicy(1.2), X0, None, torch.zeros(2), timesteps=torch.tensor([800.0, 250.0]), noise=EPS)


def test_the_old_policy_is_its_own_adapter_and_a_checkpoints_mismatch_is_named(monkeypatch):
    """`setup` makes the ``"old"`` adapter (`diffalign.reference.old_policy.OLD_ADAPTER`, the key the checkpoints and
    `use` rely on); `load_state_dict` names the checkpoint's old policy as the source of its weights (the text of
    `ReferenceAdapter.load`'s error for mismatched keys)."""
    made = []

    class Adapter:
        def __init__(self, policy, adapter_name="reference"):
            made.append((policy, adapter_name))

        def snapshot_policy(self):
            return {}

        def load(self, state, source):
            self.loaded = (state, source)

    monkeypatch.setattr(diffusion_nft, "ReferenceAdapter", Adapter)
    old, policy = SoftUpdateOldPolicy(), object()
    old.setup(policy)
    assert made == [(policy, "old")]
    weights = {"w": torch.ones(1)}
    old.load_state_dict({"step": 7, "weights": weights})
    assert old.step == 7 and old.adapter.loaded == (weights, "the checkpoint's old policy")
