"""Wan 2.2's two experts (`WanPolicy` with `transformer_2` and `boundary_ratio`) on a tiny random two-expert
`WanPipeline`: which expert a step uses follows `WanPipeline.__call__` (a zero-noise rollout equals the pipeline's,
with `guidance_scale_2` too), a batch that mixes timesteps routes each row to its expert, the LoRA on both experts or
on one (the other stays the base model), files diffusers loads into each expert, the log-prob contract, and an
epoch of Flow-GRPO in the online loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose_cfg, online_overrides, step_sampler
from diffusers import FlowMatchEulerDiscreteScheduler

from diffalign.models.tiny_video import build_tiny_wan22_pipeline, build_tiny_wan22_policy
from diffalign.models.wan import SECOND_EXPERT_WEIGHT_NAME, WanPolicy
from diffalign.samplers.rollout import recompute_log_probs, rollout

PROMPTS = ["a red circle moving left", "two blue squares staying still"]


def _perturb(policy, scale=0.1):
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


@pytest.mark.parametrize("guidance_scale_2", [None, 2.0])
def test_zero_noise_rollout_equals_the_two_expert_wan_pipeline(guidance_scale_2):
    """4 Euler steps at shift 3 have t ≈ 1000, 858, 602, 9: with boundary 0.6 (t ≥ 600: the high-noise expert) the
    first three use `transformer`, the last `transformer_2`, as WanPipeline chooses per step."""
    pipe = build_tiny_wan22_pipeline(seed=0, boundary_ratio=0.6)
    policy = WanPolicy(pipe, num_frames=9, lora_rank=4, max_sequence_length=16, guidance_scale_2=guidance_scale_2)
    noise = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=3.0, noise=0.0),
                   latents=noise, decode=False)
    t = traj.timesteps
    assert (t >= 600).any() and (t < 600).any()  # both experts take part
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=policy.scheduler.config.shift)
    out = pipe(prompt=PROMPTS, height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=3.0,
               guidance_scale_2=guidance_scale_2, latents=noise.clone(), output_type="latent",
               max_sequence_length=16).frames
    torch.testing.assert_close(traj.latents[:, -1], out.float(), rtol=1e-4, atol=1e-4)
    # and it is not the one-expert result
    policy_one = WanPolicy(build_tiny_wan22_pipeline(seed=0, boundary_ratio=0.0), num_frames=9, lora_rank=4,
                           max_sequence_length=16, guidance_scale_2=guidance_scale_2)
    one = rollout(policy_one, PROMPTS, step_sampler(policy_one, num_inference_steps=4, guidance_scale=3.0, noise=0.0),
                  latents=noise, decode=False)
    assert (one.latents[:, -1] - traj.latents[:, -1]).abs().max() > 1e-3


def test_a_mixed_batch_routes_each_row_to_its_expert():
    policy = build_tiny_wan22_policy()
    embeds = policy.encode_prompts(PROMPTS, do_classifier_free_guidance=False)
    x = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(1))
    t = torch.tensor([900.0, 100.0])
    with torch.no_grad():
        mixed = policy.predict(x, t, embeds)
        high = policy.transformer(hidden_states=x[:1], timestep=t[:1], encoder_hidden_states=embeds.prompt_embeds[:1],
                                  return_dict=False)[0]
        low = policy.transformer_2(hidden_states=x[1:], timestep=t[1:],
                                   encoder_hidden_states=embeds.prompt_embeds[1:], return_dict=False)[0]
    torch.testing.assert_close(mixed, torch.cat([high, low]).float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lora_experts", ["both", "high", "low"])
def test_lora_on_both_or_one_expert_and_files_diffusers_loads(lora_experts, tmp_path):
    from diffusers import WanPipeline

    policy = build_tiny_wan22_policy(lora_experts=lora_experts)
    per_expert = sum(p.numel() for p in build_tiny_wan22_policy(lora_experts="high").trainable_parameters())
    assert sum(p.numel() for p in policy.trainable_parameters()) == per_expert * (2 if lora_experts == "both" else 1)
    _perturb(policy)
    embeds = policy.encode_prompts(PROMPTS[:1], do_classifier_free_guidance=False)
    x = torch.randn((1, *policy.latent_shape), generator=torch.Generator().manual_seed(2))
    outs = {}
    with torch.no_grad():
        for name, t in (("high", torch.tensor([900.0])), ("low", torch.tensor([100.0]))):
            adapted = policy.predict(x, t, embeds)
            with policy.reference():
                base = policy.predict(x, t, embeds)
            moved = (adapted - base).abs().max() > 1e-4
            assert bool(moved) == (lora_experts in ("both", name)), (name, lora_experts)
            outs[name] = adapted
    policy.save_lora_weights(tmp_path)
    assert (tmp_path / SECOND_EXPERT_WEIGHT_NAME).is_file() == (lora_experts == "both")
    fresh = build_tiny_wan22_policy(lora_experts=lora_experts)
    fresh.load_lora_weights(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(fresh.predict(x, torch.tensor([100.0]), embeds), outs["low"], rtol=1e-5, atol=1e-5)
    # plain diffusers: the first file into the expert it belongs to, the second with load_into_transformer_2
    pipe = build_tiny_wan22_pipeline(seed=0)
    assert isinstance(pipe, WanPipeline)
    if lora_experts in ("both", "high"):
        pipe.load_lora_weights(str(tmp_path))
    if lora_experts == "both":
        pipe.load_lora_weights(str(tmp_path), weight_name=SECOND_EXPERT_WEIGHT_NAME, load_into_transformer_2=True)
    if lora_experts == "low":
        pipe.load_lora_weights(str(tmp_path), load_into_transformer_2=True)
    with torch.no_grad():
        for name, expert, t in (("high", pipe.transformer, 900.0), ("low", pipe.transformer_2, 100.0)):
            out = expert(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=embeds.prompt_embeds,
                         return_dict=False)[0]
            torch.testing.assert_close(out.float(), outs[name], rtol=1e-4, atol=1e-4)


def test_recomputed_log_probs_give_ratio_one_across_the_boundary():
    policy = build_tiny_wan22_policy()
    _perturb(policy, 0.05)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=3.0, noise=0.7),
                   generator=gens, decode=False)
    with torch.no_grad():
        new = recompute_log_probs(policy, traj, range(4))
    ratio = torch.exp(new - traj.log_probs)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)


def test_wan22_settings_are_refused_on_one_expert_and_checked():
    from diffalign.models.tiny_video import build_tiny_wan_pipeline

    with pytest.raises(ValueError, match="two experts"):
        WanPolicy(build_tiny_wan_pipeline(), lora_experts="low", max_sequence_length=16)
    with pytest.raises(ValueError, match="model.lora_experts='middle'"):
        build_tiny_wan22_policy(lora_experts="middle")
    pipe = build_tiny_wan_pipeline()
    pipe.register_to_config(expand_timesteps=True)  # Wan2.2 TI2V-5B's per-token timesteps
    with pytest.raises(ValueError, match="expand_timesteps"):
        WanPolicy(pipe, max_sequence_length=16)
    from diffalign.reference.adapter import ReferenceAdapter

    with pytest.raises(ValueError, match="reference=frozen_base"):  # (what reference=ema/checkpoint/pool build)
        ReferenceAdapter(build_tiny_wan22_policy())


def test_flow_grpo_runs_an_epoch_on_two_experts(tmp_path):
    from safetensors.torch import load_file

    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    # 6 steps: the trained transitions (the first 5) reach t < 500, the low-noise expert's; per-frame brightness
    # varies between a random model's videos, so the advantages are not all zero
    cfg = compose_cfg(["model=tiny_wan22_random", "method=flow_grpo", "sampler=flow_sde", "reward=[per_frame]",
                       "reward.per_frame.image_reward=brightness", "online.prompts=video_train", "eval.enabled=false"]
                      + online_overrides(tmp_path, epochs=1) + ["sampler.num_inference_steps=6"])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["rollouts"] == 8
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert math.isfinite(history[0]["loss"])
    for name in ("pytorch_lora_weights.safetensors", SECOND_EXPERT_WEIGHT_NAME):
        lora = load_file(tmp_path / "final" / name)
        assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k), name
