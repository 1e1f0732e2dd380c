"""`group_rollout` against sampling the repeated prompts batch by batch with `Sampler.sample` (each row's prompt
encoded in its batch): bit for bit by default; with ``encode_prompts_once`` (each group's prompt encoded once) the
same rollouts up to the text encoders' float rounding."""

from __future__ import annotations

import pytest
import torch

from diffalign.methods import stream_seed
from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.samplers.flow_sde import FlowSDESampler
from diffalign.samplers.groups import _STEP, group_initial_noise, group_rollout
from diffalign.samplers.ode import DPMSolverSampler

PROMPTS = ["a red circle", "two blue squares on the left", "a green triangle"]


def _nonzero_lora(policy):
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return policy


def _row_by_row(policy, sampler, group_size, *, seed, epoch, groups, batch):
    """The rollout as group_rollout drew it before: every row's prompt encoded inside `Sampler.sample`; the trained
    adapter folded for the ODE sampler only (``fuse_lora="auto"``: it stores no log-probs)."""
    noise = group_initial_noise(policy.latent_shape, groups, group_size, seed=seed, epoch=epoch, shared=False)
    prompts = [p for p in PROMPTS for _ in range(group_size)]
    members = [(g, m) for g in groups for m in range(group_size)]
    parts = []
    for start in range(0, len(prompts), batch):
        stop = min(start + batch, len(prompts))
        gens = [torch.Generator().manual_seed(stream_seed(seed, epoch, g, m, _STEP)) for g, m in members[start:stop]]
        parts.append(sampler.sample(policy, prompts[start:stop], generator=gens, latents=noise[start:stop],
                                    fuse_lora=not sampler.stochastic))
    return parts


def _check(traj, ids, parts, g, exact):
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    assert same(traj.latents, torch.cat([p.latents for p in parts]))
    assert same(traj.log_probs, torch.cat([p.log_probs for p in parts]))
    assert same(traj.images, torch.cat([p.images for p in parts]))
    for name in ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"):
        mine, before = getattr(traj.prompt_embeds, name), [getattr(p.prompt_embeds, name) for p in parts]
        assert (mine is None and before[0] is None) or same(mine, torch.cat(before)), name
    assert traj.prompts == [p for p in PROMPTS for _ in range(g)] and ids.tolist() == [4] * 3 + [9] * 3 + [11] * 3


def test_group_rollout_equals_sampling_batch_by_batch():
    policy = _nonzero_lora(build_tiny_flow_policy(seed=0))
    groups, g = [4, 9, 11], 3
    for sampler in (FlowSDESampler(num_inference_steps=3, guidance_scale=2.0, noise_level=0.7),
                    DPMSolverSampler(num_inference_steps=3, guidance_scale=1.0)):
        parts = _row_by_row(policy, sampler, g, seed=2, epoch=1, groups=groups, batch=4)
        for once in (False, True):
            traj, ids = group_rollout(policy, PROMPTS, g, sampler=sampler, group_indices=groups, seed=2, epoch=1,
                                      rollout_batch_size=4, encode_prompts_once=once)
            _check(traj, ids, parts, g, exact=not once)


def test_encode_prompts_once_encodes_each_prompt_once():
    policy = build_tiny_flow_policy(seed=0)
    encoded = []
    encode = policy.encode_prompts

    def spy(prompts, *args, **kwargs):
        encoded.append((list(prompts), kwargs.get("do_classifier_free_guidance")))
        return encode(prompts, *args, **kwargs)

    policy.encode_prompts = spy
    sampler = FlowSDESampler(num_inference_steps=2, guidance_scale=2.0, noise_level=0.7)
    kwargs = {"sampler": sampler, "group_indices": [0, 1, 2], "seed": 0, "epoch": 0, "rollout_batch_size": 5}
    group_rollout(policy, PROMPTS, 4, **kwargs)
    assert [len(p) for p, _ in encoded] == [5, 5, 2]  # every row, batch by batch
    encoded.clear()
    group_rollout(policy, PROMPTS, 4, encode_prompts_once=True, **kwargs)
    assert encoded == [(PROMPTS, True)]  # one call of P = 3 prompts; negatives with CFG


def test_fuse_lora_folds_the_trained_adapter_into_every_forward_batch():
    """``fuse_lora`` (``online.fuse_rollout_lora``): each forward batch runs with the adapter folded into the weights
    (`inference_lora` says "fused", the LoRA layers are off while the denoiser runs); the rollouts equal the unfused
    ones up to float rounding, and the weights come back bit for bit. ``"auto"`` (the default) folds for the ODE
    sampler (no stored log-probs) and leaves the stochastic one's adapter unfused (bit for bit ``fuse_lora=False``)."""
    from peft.tuners.lora import LoraLayer

    policy = _nonzero_lora(build_tiny_flow_policy(seed=0))
    layers = [m for m in policy.denoiser.modules() if isinstance(m, LoraLayer)]
    weights = {k: v.clone() for k, v in policy.denoiser.state_dict().items()}
    adapters_off = []
    hook = policy.denoiser.register_forward_pre_hook(
        lambda module, args: adapters_off.append(all(layer.disable_adapters for layer in layers)))
    kwargs = {"group_indices": [4, 9, 11], "seed": 2, "epoch": 1, "rollout_batch_size": 4}
    try:
        for sampler, auto_fuses in ((FlowSDESampler(num_inference_steps=3, guidance_scale=2.0, noise_level=0.7), False),
                                    (DPMSolverSampler(num_inference_steps=3, guidance_scale=1.0), True)):
            adapters_off.clear()
            plain, _ = group_rollout(policy, PROMPTS, 3, sampler=sampler, fuse_lora=False, **kwargs)
            assert adapters_off and not any(adapters_off)  # the trained adapter runs unfused
            adapters_off.clear()
            fused, ids = group_rollout(policy, PROMPTS, 3, sampler=sampler, fuse_lora=True, **kwargs)
            assert len(adapters_off) == 3 * len(plain.timesteps) and all(adapters_off)  # 3 batches of 4, 4, 1 rows
            torch.testing.assert_close(fused.latents, plain.latents, rtol=0, atol=1e-4)
            torch.testing.assert_close(fused.log_probs, plain.log_probs, rtol=0, atol=1e-3)
            assert ids.tolist() == [4] * 3 + [9] * 3 + [11] * 3
            adapters_off.clear()
            auto, _ = group_rollout(policy, PROMPTS, 3, sampler=sampler, **kwargs)
            assert adapters_off and all(adapters_off) == auto_fuses and any(adapters_off) == auto_fuses
            assert torch.equal(auto.latents, (fused if auto_fuses else plain).latents)
        with pytest.raises(ValueError, match="fuse_lora"):
            group_rollout(policy, PROMPTS, 3, sampler=sampler, fuse_lora="yes", **kwargs)
    finally:
        hook.remove()
    assert all(torch.equal(weights[k], v) for k, v in policy.denoiser.state_dict().items())
