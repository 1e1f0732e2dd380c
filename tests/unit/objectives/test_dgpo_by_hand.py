"""DGPO's loss on a case small enough to compute by hand (issue 35; docs/methods/algorithms.md#dgpo,
arXiv:2510.08425 Eq. 17 and the released surrogate).

A stand-in policy on one-number latents whose prediction is a trainable value v_i (θ), a fixed r_i (the reference,
inside ``policy.reference()``) or o_i (θ⁻, inside the old policy's ``use``), and whose target is the noise ε_i, so
ℓ_i = (pred_i − ε_i)². Two groups of G = 2, β = 2 (β/G = 1):

| group | i | A  | ε | v   | r | o   | ℓθ   | ℓref | ℓold |
|-------|---|----|---|-----|---|-----|------|------|------|
| 7     | 0 | 1  | 0 | 1   | 1 | 2   | 1    | 1    | 4    |
| 7     | 1 | −1 | 0 | 2   | 1 | 2   | 4    | 1    | 4    |
| 3     | 2 | −1 | 1 | 1.5 | 1 | 1   | 0.25 | 0    | 0    |
| 3     | 3 | 1  | 1 | 1   | 1 | 1   | 0    | 0    | 0    |

z_7 = 1·(1·0 − 1·3) = −3 and z_3 = 1·(−1·0.25 + 1·0) = −0.25. The surrogate is mean_i σ(z_g) A_i ℓθ_i =
(σ(−3)(1 − 4) + σ(−0.25)(−0.25 + 0)) / 4, its gradient in v_i is σ(z_g) A_i · 2(v_i − ε_i) / 4, and the boxed loss
mean_g −log σ(−z_g) = (log(1 + e^{−3}) + log(1 + e^{−0.25})) / 2 has β times that gradient.
With the clip (ε_c = 0.01), ρ_i = exp(ℓold − ℓθ): row 0 (A > 0, ρ = e³) and row 2 (A ≤ 0, ρ = e^{−0.25}) are clipped.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import OneNumberOldPolicy, OneNumberPolicy, boxed_group_loss, column

from diffalign.objectives.dgpo import DGPO
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.types import GroupBatch

A = [1.0, -1.0, -1.0, 1.0]
EPS = [0.0, 0.0, 1.0, 1.0]
V, R, O = [1.0, 2.0, 1.5, 1.0], [1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0]
GROUPS = [7, 7, 3, 3]
BETA, G = 2.0, 2


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def run(policy, **kwargs):
    batch = GroupBatch(torch.zeros(4, 1, 1, 1), ["p"] * 4, None, torch.tensor(A), torch.tensor(GROUPS), G)
    loss, metrics = DGPO(beta=BETA, **kwargs)(policy, batch, timesteps=torch.tensor(500.0), noise=column(EPS),
                                               reference=FrozenBaseReference(), old_policy=OneNumberOldPolicy())
    (grad,) = torch.autograd.grad(loss, [policy.v])
    return loss.detach(), grad.flatten(), metrics


def test_surrogate_loss_weights_and_gradient_by_hand():
    loss, grad, metrics = run(OneNumberPolicy(V, r=R, o=O))
    s7, s3 = sigmoid(-3.0), sigmoid(-0.25)
    assert float(loss) == pytest.approx((s7 * (1 - 4) + s3 * (-0.25 + 0)) / 4, rel=1e-6)
    assert float(metrics["dgpo_z"]) == pytest.approx((-3 - 3 - 0.25 - 0.25) / 4, rel=1e-6)
    assert float(metrics["dgpo_weight"]) == pytest.approx((2 * s7 + 2 * s3) / 4, rel=1e-6)
    assert float(metrics["loss_diff"]) == pytest.approx((0 + 3 + 0.25 + 0) / 4, rel=1e-6)
    # ∂/∂v_i = σ(z_g) A_i 2 (v_i − ε_i) / 4
    expected = torch.tensor([s7 * 1 * 2 * 1, s7 * -1 * 2 * 2, s3 * -1 * 2 * 0.5, s3 * 1 * 2 * 0]) / 4
    torch.testing.assert_close(grad, expected)
    assert float(metrics["clipfrac"]) == 0.0


def test_boxed_group_loss_by_hand_and_its_gradient_is_beta_times_the_surrogate():
    """The oracle against its hand values; then β·∇L_sur = ∇ mean_g L_g (the module docstring's claim)."""
    v = torch.tensor(V, requires_grad=True)
    eps, ref = torch.tensor(EPS), torch.tensor(R)
    loss_theta, loss_ref = (v - eps) ** 2, (ref - eps) ** 2
    adv = torch.tensor(A)
    boxed = [boxed_group_loss(loss_theta[s], loss_ref[s], adv[s], BETA, G) for s in (slice(0, 2), slice(2, 4))]
    assert float(boxed[0]) == pytest.approx(math.log(1 + math.exp(-3.0)), rel=1e-6)
    assert float(boxed[1]) == pytest.approx(math.log(1 + math.exp(-0.25)), rel=1e-6)
    (boxed_grad,) = torch.autograd.grad(torch.stack(boxed).mean(), [v])
    _, grad, _ = run(OneNumberPolicy(V, r=R, o=O))
    torch.testing.assert_close(BETA * grad, boxed_grad)


def test_clip_detaches_the_rows_outside_the_range_by_hand():
    loss, grad, metrics = run(OneNumberPolicy(V, r=R, o=O), clip_range=0.01)
    s7, s3 = sigmoid(-3.0), sigmoid(-0.25)
    assert float(loss) == pytest.approx((s7 * (1 - 4) + s3 * (-0.25 + 0)) / 4, rel=1e-6)  # the value is unchanged
    assert float(metrics["clipfrac"]) == 0.5
    expected = torch.tensor([0.0, s7 * -1 * 2 * 2, 0.0, s3 * 1 * 2 * 0]) / 4  # rows 0 and 2 detached
    torch.testing.assert_close(grad, expected)


def test_kl_term_to_the_frozen_base_by_hand():
    """β_KL · mean (v − r)² = 0.1 · (0 + 1 + 0.25 + 0) / 4, gradient 0.1 · 2 (v − r) / 4 added."""
    loss, grad, metrics = run(OneNumberPolicy(V, r=R, o=O), beta_kl=0.1)
    s7, s3 = sigmoid(-3.0), sigmoid(-0.25)
    assert float(metrics["kl"]) == pytest.approx(1.25 / 4, rel=1e-6)
    assert float(loss) == pytest.approx((s7 * (1 - 4) + s3 * (-0.25 + 0)) / 4 + 0.1 * 1.25 / 4, rel=1e-6)
    surrogate = torch.tensor([s7 * 2, s7 * -4, s3 * -1, 0.0]) / 4
    torch.testing.assert_close(grad, surrogate + 0.1 * 2 * torch.tensor([0.0, 1.0, 0.5, 0.0]) / 4)
