"""DGPO: the surrogate's gradient equals the paper's group loss gradient; noise sharing; timestep clip; θ⁻."""

from __future__ import annotations

import pytest
import torch
from conftest import boxed_group_loss

from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.objectives.common import per_sample_mse
from diffalign.objectives.dgpo import DGPO, group_noise, select_train_timesteps
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.reference.old_policy import EmaRolloutPolicy
from diffalign.samplers.flow_sde import FlowSDESampler
from diffalign.samplers.groups import group_initial_noise, group_rollout
from diffalign.samplers.ode import DPMSolverSampler
from diffalign.types import GroupBatch


def _policy_with_nonzero_lora(seed=0):
    policy = build_tiny_flow_policy(seed=seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy


def test_surrogate_gradient_equals_the_boxed_group_loss_gradient():
    policy = _policy_with_nonzero_lora()
    reference = FrozenBaseReference()
    reference.setup(policy)
    G, groups = 3, [4, 7]
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(G * len(groups), 4, 8, 8, generator=gen)
    adv = torch.tensor([1.2, -0.4, -0.8, 0.3, 0.9, -1.2])
    gids = torch.tensor([g for g in groups for _ in range(G)])
    noise = group_noise((4, 8, 8), gids, seed=0, epoch=0, timestep_index=0)
    prompts = ["a red circle"] * G + ["two blue squares"] * G
    embeds = policy.encode_prompts(prompts, do_classifier_free_guidance=False)
    batch = GroupBatch(x0, prompts, embeds, adv, gids, G)
    t = torch.tensor(700.0)
    beta = 50.0
    params = policy.trainable_parameters()

    loss, _ = DGPO(beta=beta)(policy, batch, timesteps=t, noise=noise, reference=reference)
    surrogate_grads = torch.autograd.grad(loss, params)

    # reference computation: autograd of −log σ(−(β/G) Σ_i A_i (ℓθ_i − ℓref_i)), averaged over the groups
    x_t = policy.add_noise(x0, noise, t.expand(len(x0)))
    target = policy.training_target(x0, noise)
    loss_theta = per_sample_mse(policy.predict(x_t, t, embeds), target)
    with torch.no_grad(), policy.reference():
        loss_ref = per_sample_mse(policy.predict(x_t, t, embeds), target)
    boxed = torch.stack([boxed_group_loss(loss_theta[i * G:(i + 1) * G], loss_ref[i * G:(i + 1) * G],
                                          adv[i * G:(i + 1) * G], beta, G) for i in range(len(groups))]).mean()
    boxed_grads = torch.autograd.grad(boxed, params)
    for s, b in zip(surrogate_grads, boxed_grads):
        torch.testing.assert_close(beta * s, b, rtol=1e-4, atol=1e-7)
    assert any(b.abs().sum() > 0 for b in boxed_grads)


def test_policy_equal_to_reference_gives_weight_one_half_and_ppo_clip_detaches():
    policy = build_tiny_flow_policy(seed=0)  # fresh LoRA: B = 0, so θ = reference
    reference = FrozenBaseReference()
    reference.setup(policy)
    old = EmaRolloutPolicy(switch_step=0)
    old.setup(policy)
    G = 2
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    gids = torch.tensor([0, 0])
    embeds = policy.encode_prompts(["a red circle"] * 2, do_classifier_free_guidance=False)
    batch = GroupBatch(x0, ["a red circle"] * 2, embeds, torch.tensor([1.0, -1.0]), gids, G)
    noise = group_noise((4, 8, 8), gids, seed=0, epoch=0, timestep_index=0)
    _, metrics = DGPO(beta=100, clip_range=0.01)(policy, batch, timesteps=torch.tensor(600.0), noise=noise,
                                                 reference=reference, old_policy=old)
    assert metrics["dgpo_weight"].item() == pytest.approx(0.5)
    assert metrics["dgpo_z"].item() == 0.0 and metrics["clipfrac"].item() == 0.0


def test_training_noise_is_shared_inside_a_group_only():
    gids = torch.tensor([3, 3, 3, 8, 8, 8])
    noise = group_noise((4, 8, 8), gids, seed=0, epoch=2, timestep_index=1)
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], noise[3])
    other_t = group_noise((4, 8, 8), gids, seed=0, epoch=2, timestep_index=0)
    assert not torch.equal(noise[0], other_t[0])


def test_initial_noise_shared_inside_a_group_only_and_rollouts_reproduce_bit_for_bit():
    shared = group_initial_noise((4, 8, 8), [0, 1], 3, seed=0, epoch=0, shared=True)
    assert torch.equal(shared[0], shared[1]) and torch.equal(shared[1], shared[2])
    assert not torch.equal(shared[0], shared[3])  # never across groups
    independent = group_initial_noise((4, 8, 8), [0, 1], 3, seed=0, epoch=0, shared=False)
    assert len({tuple(r.flatten()[:4].tolist()) for r in independent}) == 6
    # another process's groups (other global indices) never repeat these noises
    other = group_initial_noise((4, 8, 8), [2, 3], 3, seed=0, epoch=0, shared=False)
    assert not any(torch.equal(a, b) for a in independent for b in other)

    policy = build_tiny_flow_policy(seed=0)
    kwargs = {"group_indices": [5, 6], "seed": 1, "epoch": 3}
    sde = FlowSDESampler(num_inference_steps=3, guidance_scale=2.0, noise_level=0.7)
    a, ids = group_rollout(policy, ["a red circle", "a blue square"], 2, sampler=sde, rollout_batch_size=4, **kwargs)
    b, _ = group_rollout(policy, ["a red circle", "a blue square"], 2, sampler=sde, rollout_batch_size=4, **kwargs)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    # another chunking draws the same noise streams; only float rounding of the batched forward differs
    e, _ = group_rollout(policy, ["a red circle", "a blue square"], 2, sampler=sde, rollout_batch_size=1, **kwargs)
    torch.testing.assert_close(e.latents, a.latents, rtol=1e-4, atol=1e-4)
    assert ids.tolist() == [5, 5, 6, 6]
    ode = DPMSolverSampler(num_inference_steps=3, guidance_scale=2.0)
    c, _ = group_rollout(policy, ["a red circle", "a blue square"], 2, sampler=ode, **kwargs)
    d, _ = group_rollout(policy, ["a red circle", "a blue square"], 2, sampler=ode, **kwargs)
    assert torch.equal(c.latents, d.latents)


def test_timestep_clip_draws_distinct_high_noise_timesteps():
    schedule = torch.tensor([999, 963, 922, 874, 817, 749, 666, 562, 428, 249])
    chosen = select_train_timesteps(schedule, 4, 4, generator=torch.Generator().manual_seed(0))
    assert len(set(chosen.tolist())) == 4 and set(chosen.tolist()) <= set(schedule[:5].tolist())
    with pytest.raises(ValueError, match="timesteps_per_epoch"):
        select_train_timesteps(schedule, 6, 4)


def test_rollout_policy_is_theta_until_the_switch_then_an_ema():
    policy = _policy_with_nonzero_lora()
    old = EmaRolloutPolicy(switch_step=2, decay=0.3, ramp=0.1)
    old.setup(policy)
    start = {k: v.clone() for k, v in old.adapter.params.items()}
    assert not old.active
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(1.0)
    old.after_update()  # step 1: d = min(0.3, 0.1) = 0.1 → θ⁻ = 0.1 θ⁻ + 0.9 θ
    key = next(iter(start))
    expected = 0.1 * start[key] + 0.9 * old.adapter.policy_params[key].detach()
    torch.testing.assert_close(old.adapter.params[key], expected)
    old.after_update()
    assert old.active


def test_kl_term_is_taken_against_the_base_while_the_dpo_term_uses_an_ema_reference():
    from diffalign.reference.ema import EmaReference

    # released scripts/train_sd3_dgpo.py: ref_old_v under `transformer.module.disable_adapter()`, the KL is
    # mean((model_v − ref_old_v)²) and, with use_ema_ref, only the DPO term's reference becomes the EMA's prediction
    policy = _policy_with_nonzero_lora()
    reference = EmaReference(decay=0.5)
    reference.setup(policy)  # the EMA adapter = the policy's current LoRA …
    with torch.no_grad():  # … then the policy moves on: θ ≠ θ_ema ≠ base
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 1)))
    G = 2
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    gids = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([0.7, -0.7, -1.0, 1.0])
    prompts = ["a red circle"] * 2 + ["two blue squares"] * 2
    embeds = policy.encode_prompts(prompts, do_classifier_free_guidance=False)
    batch = GroupBatch(x0, prompts, embeds, adv, gids, G)
    noise = group_noise((4, 8, 8), gids, seed=0, epoch=0, timestep_index=0)
    t = torch.tensor(650.0)
    beta, beta_kl = 40.0, 0.3

    # by hand: the three models' predictions at the same x_t
    tt = t.expand(len(x0))
    x_t = policy.add_noise(x0, noise, tt)
    target = policy.training_target(x0, noise, tt)
    with torch.no_grad():
        v_theta = policy.predict(x_t, tt, embeds, guidance_scale=1.0)
        with policy.reference():
            v_base = policy.predict(x_t, tt, embeds, guidance_scale=1.0)
        with reference.use(policy):
            v_ema = policy.predict(x_t, tt, embeds, guidance_scale=1.0)
    kl_base = ((v_theta - v_base) ** 2).mean()
    kl_ema = ((v_theta - v_ema) ** 2).mean()
    assert (kl_base - kl_ema).abs() > 1e-3 * kl_base  # the two references really differ
    l_theta = ((v_theta - target) ** 2).flatten(1).mean(1)
    l_ema = ((v_ema - target) ** 2).flatten(1).mean(1)
    z_group = [beta / G * (adv[g * G:(g + 1) * G] * (l_theta - l_ema)[g * G:(g + 1) * G]).sum() for g in range(2)]
    z = torch.stack([z_group[0], z_group[0], z_group[1], z_group[1]])
    dpo = (torch.sigmoid(z) * adv * l_theta).mean()

    loss, metrics = DGPO(beta=beta, beta_kl=beta_kl, kl_reference="base")(
        policy, batch, timesteps=t, noise=noise, reference=reference)
    torch.testing.assert_close(metrics["kl"], kl_base, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(metrics["dgpo_z"], z.mean(), rtol=1e-5, atol=1e-6)  # DPO term: the EMA reference
    torch.testing.assert_close(loss.detach(), dpo + beta_kl * kl_base, rtol=1e-5, atol=1e-7)
    # the alternative: the KL against the reference strategy too
    loss_ref, metrics_ref = DGPO(beta=beta, beta_kl=beta_kl, kl_reference="reference")(
        policy, batch, timesteps=t, noise=noise, reference=reference)
    torch.testing.assert_close(metrics_ref["kl"], kl_ema, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(loss_ref.detach(), dpo + beta_kl * kl_ema, rtol=1e-5, atol=1e-7)
    assert DGPO().kl_reference == "base"
    with pytest.raises(ValueError, match="method.kl_reference"):
        DGPO(kl_reference="ema")
    from conftest import compose_cfg

    for overrides in (["method=dgpo"], ["recipe=dgpo_sd35_geneval"], ["recipe=tiny_dgpo", "reference=ema"]):
        assert compose_cfg(overrides).method.kl_reference == "base"
