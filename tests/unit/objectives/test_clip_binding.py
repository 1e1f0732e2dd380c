"""The PPO clip of the policy-gradient objectives where it binds (issue 35): ratios set outside [1 − ε, 1 + ε] for
positive and negative advantages, with the loss and its gradient computed by hand from the clipped surrogate
(PPO, arXiv:1707.06347, eq. 7; docs/methods/algorithms.md#flow-grpo, docs/methods/algorithms.md#vipo):

    term(A, ρ) = max(−A ρ, −A clip(ρ, 1 − ε, 1 + ε))

With ε = 0.2 the four cases outside the range are (A = 2 or −1, ρ = 1.5 or 0.5):

| A  | ρ   | −A ρ | −A clip(ρ) | max  | binding?                               |
|----|-----|------|------------|------|----------------------------------------|
| 2  | 1.5 | −3.0 | −2.4       | −2.4 | clipped: no gradient                   |
| 2  | 0.5 | −1.0 | −1.6       | −1.0 | unclipped                              |
| −1 | 1.5 | 1.5  | 1.2        | 1.5  | unclipped                              |
| −1 | 0.5 | 0.5  | 0.8        | 0.8  | clipped: no gradient                   |

The ratio is made exact by storing log π_old = log π_θ − log ρ for the transition trained (the policy's own
recomputed log-prob), on both model families (eps-prediction with DDIM-η, flow matching with the Flow-GRPO SDE).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import step_sampler

from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.policy_gradient import ClippedPolicyGradient
from diffalign.objectives.vipo import ViPO
from diffalign.samplers.rollout import recompute_step, rollout

EPS = 0.2
K = 1  # the transition trained
PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle", "a blue square",
           "a yellow circle", "two red triangles"]


def policy_for(family: str):
    """(tiny policy with non-zero LoRA weights, the rollout's noise level)."""
    policy = build_tiny_flow_policy(seed=0) if family == "flow" else build_tiny_random_policy(seed=0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy, (0.7 if family == "flow" else 1.0)


def with_ratios(policy, eta: float, ratios: torch.Tensor, reduction: str):
    """A rollout of ``len(ratios)`` prompts whose stored log-probs at transition `K` are log π_θ − log `ratios`, so
    that π_θ / π_old = `ratios` (`(B,)` for "mean", `(B, h, w)` for "per_position")."""
    gens = [torch.Generator().manual_seed(i) for i in range(len(ratios))]
    traj = rollout(policy, PROMPTS[:len(ratios)],
                   step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta), generator=gens,
                   reduction=reduction)
    with torch.no_grad():
        now = recompute_step(policy, traj, K, reduction=reduction, detach_unconditional=True).log_prob
    assert now.shape == ratios.shape
    log_probs = traj.log_probs.clone()
    log_probs[:, K] = now - ratios.log()
    return dataclasses.replace(traj, log_probs=log_probs)


def reference_gradient(policy, traj, coefficients: torch.Tensor, reduction: str) -> list[torch.Tensor]:
    """∇θ of Σ c · log π_θ: with c = −A ρ / n on the unclipped entries and 0 on the clipped ones, the gradient of the
    clipped surrogate (∇ρ = ρ ∇ log π)."""
    log_prob = recompute_step(policy, traj, K, reduction=reduction, detach_unconditional=True).log_prob
    return list(torch.autograd.grad((coefficients * log_prob).sum(), policy.trainable_parameters()))


def loss_and_gradient(objective, policy, traj, adv, **kwargs):
    loss, metrics = objective(policy, traj, adv, K, **kwargs)
    return loss, list(torch.autograd.grad(loss, policy.trainable_parameters())), metrics


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_clipped_policy_gradient_clip_binds_by_hand(family):
    policy, eta = policy_for(family)
    # the four out-of-range cases of the table, then two ratios inside the range (A = 2, ρ = 1.1; A = −1, ρ = 0.95)
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1, 0.95])
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0, 2.0, -1.0])
    traj = with_ratios(policy, eta, ratios, "mean")
    objective = ClippedPolicyGradient(clip_range=EPS, detach_unconditional=True)
    loss, grads, metrics = loss_and_gradient(objective, policy, traj, adv)
    # by hand: (−2.4 − 1.0 + 1.5 + 0.8 − 2.2 + 0.95) / 6
    torch.testing.assert_close(loss, torch.tensor(-2.35 / 6), rtol=1e-4, atol=1e-5)
    assert float(metrics["clipfrac"]) == pytest.approx(4 / 6)
    assert float(metrics["ratio"]) == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1 + 0.95) / 6, rel=1e-4)
    # the gradient flows through the unclipped rows only (rows 0 and 3 are clipped)
    unclipped = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    expected = reference_gradient(policy, traj, unclipped * -adv * ratios / 6, "mean")
    assert any(e.abs().sum() > 0 for e in expected)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-7)


def quadrant_case(grid: tuple[int, int], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratios, advantage maps), both `(B, h, w)`: ρ = 1.5 on the left half of the latent grid and 0.5 on the right;
    A = 2 on the top half and −1 on the bottom, so each case of the table holds a quarter of the positions."""
    h, w = grid
    assert h % 2 == 0 and w % 2 == 0
    ratios = torch.full((batch, h, w), 0.5)
    ratios[:, :, : w // 2] = 1.5
    adv = torch.full((batch, h, w), -1.0)
    adv[:, : h // 2] = 2.0
    return ratios, adv


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_vipo_per_position_clip_binds_by_hand(family):
    policy, eta = policy_for(family)
    grid = tuple(policy.latent_shape[1:])
    ratios, adv_map = quadrant_case(grid, 4)
    traj = with_ratios(policy, eta, ratios, "per_position")
    vipo = ViPO(clip_range=EPS, map="ones", advantage_clip=None)
    rows = torch.arange(4)
    vipo.prepare_epoch(policy, traj, torch.ones(4))
    vipo.advantage_maps = adv_map  # the per-position advantages of the case (a map ≠ 1 with mixed signs)
    loss, grads, metrics = loss_and_gradient(vipo, policy, traj, torch.ones(4), rows=rows)
    # by hand: the mean of the table's four max values, each a quarter of the positions
    torch.testing.assert_close(loss, torch.tensor((-2.4 - 1.0 + 1.5 + 0.8) / 4), rtol=1e-4, atol=1e-5)
    assert float(metrics["clipfrac"]) == 1.0
    # clipped: (A = 2, ρ = 1.5) top-left and (A = −1, ρ = 0.5) bottom-right
    clipped = ((adv_map > 0) & (ratios > 1)) | ((adv_map < 0) & (ratios < 1))
    assert clipped.float().mean() == 0.5
    expected = reference_gradient(policy, traj, (~clipped).float() * -adv_map * ratios / adv_map.numel(),
                                  "per_position")
    assert any(e.abs().sum() > 0 for e in expected)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_vipo_scalar_weighted_clip_binds_by_hand(family):
    """The released FLUX form (one log-prob per sample) with the four cases of the table, one per row."""
    policy, eta = policy_for(family)
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5])
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    traj = with_ratios(policy, eta, ratios, "mean")
    vipo = ViPO(clip_range=EPS, reduction="scalar_weighted", map="ones")
    rows = torch.arange(4)
    vipo.prepare_epoch(policy, traj, adv)
    loss, grads, _ = loss_and_gradient(vipo, policy, traj, adv, rows=rows)
    torch.testing.assert_close(loss, torch.tensor((-2.4 - 1.0 + 1.5 + 0.8) / 4), rtol=1e-4, atol=1e-5)
    expected = reference_gradient(policy, traj, torch.tensor([0.0, 1.0, 1.0, 0.0]) * -adv * ratios / 4, "mean")
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-7)


def test_advantage_clip_of_vipo_maps_is_by_hand():
    """A^p = clip(M A, ±5) (released code): A = 8 on a map of 1 and 0.5 gives 5 and 4; A = −12 gives −5 and −5."""
    from diffalign.vipo.psm import advantage_maps

    maps = torch.tensor([[[1.0, 0.5]], [[1.0, 0.5]]])
    out = advantage_maps(maps, torch.tensor([8.0, -12.0]), 5.0)
    assert out.tolist() == [[[5.0, 4.0]], [[-5.0, -5.0]]]
