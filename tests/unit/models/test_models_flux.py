"""The FLUX.1 family (`diffalign.models.flux`) on the tiny random FLUX model: FluxPipeline parity of the zero-noise
rollout, the schedule's resolution-dependent shift computed by hand, the guidance input of distilled models and true
CFG of the others, the log-prob contract, LoRA files diffusers loads, the kohya/ComfyUI key map checked against
diffusers' own converter, and one epoch of Flow-GRPO, ViPO and DiffusionNFT in the online loop."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import compose_cfg, online_overrides, step_sampler
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

from diffalign.models.flux import FluxFlowMatchScheduler, FluxPolicy, unpack_latents
from diffalign.models.tiny_flux import TINY_FLUX_MAX_SEQUENCE_LENGTH as MAX_LEN
from diffalign.models.tiny_flux import build_tiny_flux_pipeline, build_tiny_flux_policy
from diffalign.samplers.rollout import recompute_log_probs, recompute_step, rollout

PROMPTS = ["a red circle", "two blue squares"]


def _perturb(policy, scale=0.05):
    """A non-zero adapter (B = 0 after init), so the checks cover the LoRA path."""
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def _gens(n=2, offset=0):
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


# ------------------------------------------------------------------------------------------------ FluxPipeline parity


@pytest.mark.parametrize("variant", ["distilled", "true_cfg", "fixed_shift"])
def test_zero_noise_rollout_equals_flux_pipeline(variant):
    """η = 0 rollouts equal `FluxPipeline.__call__` with the same generators: the guidance-distilled model
    (guidance_scale → the guidance input), the model without guidance embedding (true CFG with the empty negative
    prompt) and a fixed shift 3 (a pipeline whose scheduler has no dynamic shifting)."""
    pipe = build_tiny_flux_pipeline(seed=3, guidance_embeds=variant != "true_cfg")
    flow_shift = None
    if variant == "fixed_shift":
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
        flow_shift = 3.0
    policy = FluxPolicy(pipe, height=32, width=32, flow_shift=flow_shift, max_sequence_length=MAX_LEN)
    w = 4.0 if variant == "true_cfg" else 3.5
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=6, guidance_scale=w, noise=0.0),
                   generator=_gens(), decode=True)
    kwargs = {"true_cfg_scale": w, "negative_prompt": [""] * 2} if variant == "true_cfg" else {"guidance_scale": w}
    with policy.reference():  # a fresh LoRA is exactly zero, but compare against the bare transformer anyway
        packed = pipe(PROMPTS, height=32, width=32, num_inference_steps=6, generator=_gens(), output_type="latent",
                      max_sequence_length=MAX_LEN, **kwargs).images
        images = pipe(PROMPTS, height=32, width=32, num_inference_steps=6, generator=_gens(), output_type="pt",
                      max_sequence_length=MAX_LEN, **kwargs).images
    assert packed.shape == (2, 16, 16) and traj.latents.shape == (2, 7, 4, 8, 8)
    expected = FluxPipeline._unpack_latents(packed, 32, 32, pipe.vae_scale_factor)
    torch.testing.assert_close(traj.latents[:, -1], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traj.images, images, rtol=1e-4, atol=1e-4)
    assert traj.sampler == "flow_sde" and traj.sigmas.shape == (7,)


def test_schedule_is_the_resolution_dependent_shift_computed_by_hand():
    """σ_k = e^μ / (e^μ + 1/s_k − 1), s_k = linspace(1, 1/K, K), μ on the line through (256 tokens, 0.5) and
    (4096, 1.15) (FLUX.1-dev's scheduler config; arXiv:2403.03206 §5.3.2 for the shift): 16 tokens for the tiny 32 px
    model, 4096 = (1024/16)² at 1024 px where μ = 1.15; a fixed shift s gives sσ / (1 + (s − 1)σ)."""
    def by_hand(tokens, k):
        mu = 0.5 + (tokens - 256) * (1.15 - 0.5) / (4096 - 256)
        s = np.linspace(1.0, 1.0 / k, k)
        return [math.exp(mu) / (math.exp(mu) + 1 / x - 1) for x in s] + [0.0]

    policy = build_tiny_flux_policy()
    policy.scheduler.set_timesteps(5)
    torch.testing.assert_close(policy.scheduler.sigmas.double(), torch.tensor(by_hand(16, 5), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(policy.scheduler.timesteps, policy.scheduler.sigmas[:-1] * 1000)
    big = FluxFlowMatchScheduler.from_config(dict(policy.scheduler.config, image_seq_len=4096))
    assert big.mu == pytest.approx(1.15) and big.effective_shift == pytest.approx(math.exp(1.15))
    big.set_timesteps(4)
    torch.testing.assert_close(big.sigmas.double(), torch.tensor(by_hand(4096, 4), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    fixed = build_tiny_flux_policy(flow_shift=3.0).scheduler
    fixed.set_timesteps(4)
    s = np.linspace(1.0, 0.25, 4)
    torch.testing.assert_close(fixed.sigmas.double(), torch.tensor([3 * x / (1 + 2 * x) for x in s] + [0.0],
                                                                   dtype=torch.float64), rtol=1e-6, atol=1e-7)
    # a copy through from_config (what DiffusionNFT's training schedule and the Euler ODE make) keeps the resolution
    copy = type(policy.scheduler).from_config(policy.scheduler.config)
    copy.set_timesteps(5)
    torch.testing.assert_close(copy.sigmas, policy.scheduler.sigmas)


def test_latents_are_the_unpacked_vae_grid_and_unpacking_inverts_the_pipelines_packing():
    policy = build_tiny_flux_policy()
    assert policy.latent_shape == (4, 8, 8) and policy.vae_scale_factor == 4
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    packed = FluxPipeline._pack_latents(x, 2, 4, 8, 8)
    assert packed.shape == (2, 16, 16)
    # token (i, j) holds channels c of the 2x2 cell at rows 2i..2i+1, cols 2j..2j+1, in order (c, dy, dx)
    assert torch.equal(packed[1, 1 * 4 + 2].view(4, 2, 2), x[1, :, 2:4, 4:6])
    assert torch.equal(unpack_latents(packed, 8, 8), x)
    images = policy.decode(x)
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    back = policy.encode_images(images)
    assert back.shape == (2, 4, 8, 8)


# --------------------------------------------------------------------------------------------------------- guidance


def test_distilled_guidance_goes_to_the_transformers_guidance_input():
    policy = build_tiny_flux_policy()
    _perturb(policy)
    embeds = policy.encode_prompts(PROMPTS)  # CFG requested, but a distilled model has no negative branch
    assert embeds.negative_prompt_embeds is None and embeds.prompt_embeds.shape == (2, MAX_LEN, 32)
    assert embeds.pooled_prompt_embeds.shape == (2, 32)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([900.0, 300.0])
    with torch.no_grad():
        out = policy.predict(x, t, embeds, guidance_scale=3.5)
        direct = policy.transformer(
            hidden_states=FluxPipeline._pack_latents(x, 2, 4, 8, 8), timestep=t / 1000,
            guidance=torch.full((2,), 3.5), pooled_projections=embeds.pooled_prompt_embeds,
            encoder_hidden_states=embeds.prompt_embeds, txt_ids=torch.zeros(MAX_LEN, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32), return_dict=False)[0]
        other = policy.predict(x, t, embeds, guidance_scale=1.0)
    torch.testing.assert_close(out, FluxPipeline._unpack_latents(direct, 32, 32, 4))
    assert not torch.allclose(out, other)  # the guidance value reaches the model
    fixed = build_tiny_flux_policy(guidance=3.5)
    _perturb(fixed)
    with torch.no_grad():
        torch.testing.assert_close(fixed.predict(x, t, embeds), out)  # guidance_scale 1: the fixed 3.5
    with pytest.raises(ValueError, match="model.guidance=3.5"):
        fixed.predict(x, t, embeds, guidance_scale=2.0)


def test_without_guidance_embedding_guidance_is_true_cfg_of_two_calls():
    from diffalign.types import PromptEmbeds

    policy = build_tiny_flux_policy(guidance_embeds=False)
    embeds = policy.encode_prompts(PROMPTS, negative_prompts=["blue"])
    negative = PromptEmbeds(embeds.negative_prompt_embeds, None, embeds.negative_pooled_prompt_embeds)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    t = torch.tensor([800.0, 200.0])
    with torch.no_grad():
        guided = policy.predict(x, t, embeds, guidance_scale=4.0)
        cond, uncond = policy.predict(x, t, embeds), policy.predict(x, t, negative)
    torch.testing.assert_close(guided, uncond + 4.0 * (cond - uncond), rtol=1e-4, atol=1e-5)


def test_bad_flux_settings_are_refused_before_any_work():
    pipe = build_tiny_flux_pipeline()
    with pytest.raises(ValueError, match=r"model.height=36 .* multiples of 8"):
        FluxPolicy(pipe, height=36, width=32)
    with pytest.raises(ValueError, match="model.flow_shift=0"):
        FluxPolicy(pipe, height=32, width=32, flow_shift=0)
    with pytest.raises(ValueError, match="no guidance input"):
        FluxPolicy(build_tiny_flux_pipeline(guidance_embeds=False), height=32, width=32, guidance=3.5)


def test_from_pretrained_takes_the_vae_from_another_folder(tmp_path):
    """`vae=<folder>` loads that AutoencoderKL instead of the pipeline's (the shipped tiny FLUX has no VAE folder);
    a folder without config.json is refused naming model.vae, before the pipeline loads."""
    import shutil

    build_tiny_flux_pipeline(seed=0, guidance_embeds=False).save_pretrained(tmp_path / "pipe")
    other = build_tiny_flux_pipeline(seed=5).vae
    other.save_pretrained(tmp_path / "other_vae")
    shutil.rmtree(tmp_path / "pipe" / "vae")
    policy = FluxPolicy.from_pretrained(str(tmp_path / "pipe"), vae=str(tmp_path / "other_vae"), height=32, width=32,
                                        max_sequence_length=MAX_LEN)
    for (name, a), b in zip(policy.vae.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"model.vae='/no/such/vae' is not a VAE folder"):
        FluxPolicy.from_pretrained(str(tmp_path / "pipe"), vae="/no/such/vae")


# ---------------------------------------------------------------------------------------------- log-prob contract


@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance"])
def test_recomputed_log_probs_give_ratio_one_before_any_update(sde_type):
    policy = build_tiny_flux_policy(seed=0)
    _perturb(policy)
    prompts = ["a red circle", "a green triangle", "one yellow square"]
    sampler = step_sampler(policy, num_inference_steps=5, guidance_scale=3.5,
                           noise=0.7 if sde_type == "flow_grpo" else 0.3, sde_type=sde_type)
    traj = rollout(policy, prompts, sampler, generator=_gens(3, 10), decode=False)
    assert traj.trainable[:-1].all()
    with torch.no_grad():
        new = recompute_log_probs(policy, traj, range(5))
        step = recompute_step(policy, traj.index([2, 0]), 3, detach_unconditional=True)
    ratio = torch.exp(new - traj.log_probs)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    torch.testing.assert_close(step.log_prob, traj.log_probs[[2, 0], 3], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------- LoRA


def test_saved_lora_loads_in_flux_pipeline_and_reproduces_the_policy(tmp_path):
    """`save_lora_weights` writes a file `FluxPipeline.load_lora_weights` reads: a fresh pipeline with it generates
    the policy's own zero-noise samples, which differ from the base model's."""
    policy = build_tiny_flux_policy(seed=3)
    _perturb(policy, 0.2)
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=3.5, noise=0.0),
                   generator=_gens(), decode=False)
    policy.save_lora_weights(tmp_path / "final")
    pipe = build_tiny_flux_pipeline(seed=3)
    call = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 3.5, "output_type": "latent",
            "max_sequence_length": MAX_LEN}
    base = pipe(PROMPTS, generator=_gens(), **call).images
    pipe.load_lora_weights(str(tmp_path / "final"))
    adapted = pipe(PROMPTS, generator=_gens(), **call).images
    torch.testing.assert_close(FluxPipeline._unpack_latents(adapted, 32, 32, 4), traj.latents[:, -1],
                               rtol=1e-4, atol=1e-4)
    assert (adapted - base).abs().max() > 1e-3
    # and the policy reads its own file back (resume)
    other = build_tiny_flux_policy(seed=3)
    other.load_lora_weights(tmp_path / "final")
    for a, b in zip(other.trainable_parameters(), policy.trainable_parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- the online methods


@pytest.mark.parametrize("case", ["flow_grpo", "vipo", "diffusion_nft", "dgpo"])
def test_online_methods_run_an_epoch_on_flux_and_update_the_lora(case, tmp_path):
    from safetensors.torch import load_file

    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    extra = {"flow_grpo": ["method=flow_grpo", "sampler=flow_sde", "sampler.guidance_scale=3.5"],
             "vipo": ["method=vipo", "sampler=dance_sde", "online.shared_initial_noise=true",
                      "sampler.guidance_scale=3.5"],
             "diffusion_nft": ["recipe=tiny_diffusion_nft", "+model.guidance=3.5", "trainer.batch_size=4"],
             "dgpo": ["method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
                      "method.timesteps_per_epoch=2"]}[case]
    # (brightness: a reward that varies between a random model's samples, so the advantages are not all zero)
    cfg = compose_cfg(extra + online_overrides(tmp_path, epochs=1) + ["model=tiny_flux_random", "reward=[brightness]"])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["epochs"] == 1 and results["rollouts"] == 8
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and math.isfinite(history[0]["loss"])
    lora = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    assert all(k.startswith("transformer.") for k in lora)
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)


def test_diffusion_dpo_trains_on_flux_with_the_embedded_guidance_fixed(tmp_path):
    """An offline method: Diffusion-DPO's unguided training forwards run with the fixed guidance input
    (``model.guidance``); the first loss is ln 2 exactly (policy = reference before any update)."""
    from conftest import smoke_overrides

    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    cfg = compose_cfg(smoke_overrides(tmp_path, steps=2) + ["model=tiny_flux_random", "+model.guidance=3.5"])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["global_step"] == 2
    assert results["history_tail"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


# ------------------------------------------------------------------------------------------------- kohya / ComfyUI


def _real_shaped_lora(rank=2):
    """A LoRA with FLUX.1-dev's layer shapes (d = 3072, MLP 4d) on the default targets of double block 0 and single
    block 0 (q, k, v there, not the MLP input fused with them in ``linear1``) plus the single block's output layer
    (in 5d), random A and B."""
    d, gen = 3072, torch.Generator().manual_seed(0)
    shapes = {f"transformer_blocks.0.attn.{m}": (d, d) for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                                  "add_k_proj", "add_v_proj", "to_add_out")}
    shapes |= {f"single_transformer_blocks.0.attn.{m}": (d, d) for m in ("to_q", "to_k", "to_v")}
    shapes["single_transformer_blocks.0.proj_out"] = (5 * d, d)
    state = {}
    for module, (fan_in, fan_out) in shapes.items():
        state[f"{module}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        state[f"{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    return state


def test_kohya_export_has_comfyuis_flux_names_and_diffusers_converter_gives_back_the_tensors(tmp_path):
    """The export names the original FLUX layers (what ComfyUI's and Forge's FLUX loaders and kohya sd-scripts use);
    diffusers' own FLUX kohya converter (`FluxPipeline.lora_state_dict`, what `load_lora_weights` runs) splits the
    fused qkv / linear1 back into exactly the adapter's matrices, with α/r = 2 folded into A (its scale_down 2,
    scale_up 1); the MLP input fused into linear1, not adapted, comes back as zeros. diffalign reads the file back
    to the same tensors, r and α."""
    from pathlib import Path

    from diffalign.lora.io import LAYOUTS, LoraWeights, read_lora, write_kohya

    state = _real_shaped_lora(rank=2)
    modules = sorted(k.removesuffix(".lora_A.weight") for k in state if k.endswith("lora_A.weight"))
    weights = LoraWeights(Path("<test>"), "policy", "transformer", state, 2, 4.0, modules, LAYOUTS["flux"])
    file = write_kohya(weights, tmp_path / "flux.safetensors")
    from safetensors.torch import load_file

    kohya = load_file(file)
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    assert names == {f"lora_unet_double_blocks_0_{n}" for n in ("img_attn_qkv", "img_attn_proj", "txt_attn_qkv",
                                                                 "txt_attn_proj")} | \
        {"lora_unet_single_blocks_0_linear1", "lora_unet_single_blocks_0_linear2"}
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert kohya[f"{qkv}.lora_down.weight"].shape == (6, 3072) and kohya[f"{qkv}.lora_up.weight"].shape == (9216, 6)
    assert kohya[f"{qkv}.alpha"].item() == 12.0 and kohya["lora_unet_double_blocks_0_img_attn_proj.alpha"].item() == 4
    linear1 = "lora_unet_single_blocks_0_linear1"
    assert kohya[f"{linear1}.lora_up.weight"].shape == (3 * 3072 + 4 * 3072, 8)
    # the fused update is the stacked updates of the members: (12 / 6) up @ down == rows of (4 / 2) B_j A_j
    fused = 2.0 * kohya[f"{qkv}.lora_up.weight"] @ kohya[f"{qkv}.lora_down.weight"]
    member = 2.0 * state["transformer_blocks.0.attn.to_k.lora_B.weight"] @ state[
        "transformer_blocks.0.attn.to_k.lora_A.weight"]
    torch.testing.assert_close(fused[3072:6144], member)

    converted = FluxPipeline.lora_state_dict(str(file))
    converted = converted[0] if isinstance(converted, tuple) else converted
    for module in modules:
        torch.testing.assert_close(converted[f"transformer.{module}.lora_A.weight"],
                                   2.0 * state[f"{module}.lora_A.weight"], rtol=0, atol=0)
        torch.testing.assert_close(converted[f"transformer.{module}.lora_B.weight"],
                                   state[f"{module}.lora_B.weight"], rtol=0, atol=0)
    padding = [k for k in converted if "proj_mlp" in k]
    assert len(padding) == 2 and all(not converted[k].any() for k in padding)
    assert {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in converted} == set(modules) | {
        "single_transformer_blocks.0.proj_mlp"}

    back = read_lora(file)
    assert back.layout is LAYOUTS["flux"] and (back.rank, back.alpha) == (2, 4.0) and back.modules == modules
    for key, value in state.items():
        assert torch.equal(back.state[key], value)


def test_tiny_flux_kohya_export_loads_back_into_a_policy_with_the_same_outputs(tmp_path):
    from diffalign.lora.export import export
    from diffalign.lora.io import load_into_policy, read_lora

    policy = build_tiny_flux_policy(seed=1, lora_alpha=8)
    _perturb(policy, 0.2)
    policy.save_lora_weights(tmp_path / "final")
    file = export(str(tmp_path / "final"), str(tmp_path / "tiny.safetensors"))
    weights = read_lora(file)
    assert weights.source == "kohya" and (weights.rank, weights.alpha) == (4, 8.0)
    assert "single_transformer_blocks.0.attn.to_q" in weights.modules
    other = build_tiny_flux_policy(seed=1, lora_alpha=8)
    load_into_policy(other, weights)
    embeds = policy.encode_prompts(PROMPTS)
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = policy.predict(x, torch.tensor([700.0, 100.0]), embeds, 3.5)
        torch.testing.assert_close(other.predict(x, torch.tensor([700.0, 100.0]), embeds, 3.5), want,
                                   rtol=1e-5, atol=1e-6)
    # kohya -> diffusers folder (diffalign-export --format diffusers) -> a plain FluxPipeline
    export(str(file), str(tmp_path / "back"), fmt="diffusers")
    pipe = build_tiny_flux_pipeline(seed=1)
    pipe.load_lora_weights(str(tmp_path / "back"))
    with torch.no_grad():
        out = pipe.transformer(
            hidden_states=FluxPipeline._pack_latents(x, 2, 4, 8, 8), timestep=torch.tensor([0.7, 0.1]),
            guidance=torch.full((2,), 3.5), pooled_projections=embeds.pooled_prompt_embeds,
            encoder_hidden_states=embeds.prompt_embeds, txt_ids=torch.zeros(MAX_LEN, 3),
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32), return_dict=False)[0]
    torch.testing.assert_close(unpack_latents(out, 8, 8), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", ["flow_grpo_flux_pickscore", "vipo_flux", "diffusion_nft_flux"])
def test_real_size_flux_recipes_compose_and_validate(recipe, tmp_path):
    """The FLUX recipes compose on model=flux1_dev at 512 px and pass validation (with training prompts given, and
    ViPO's DINOv2 folder replaced by the bundled backbone); their FLUX settings: Flow-GRPO's guidance 3.5 and 6 SDE
    steps, ViPO's fixed shift 3 with DanceGRPO's SDE, DiffusionNFT CFG-free with the embedded guidance fixed."""
    from diffalign.config.validation import validate_train_config
    from diffalign.samplers.base import build_sampler

    def noise_scale(node):
        return build_sampler(node).noise

    extra = ["method.backbone=tiny_clip"] if recipe == "vipo_flux" else []
    cfg = compose_cfg([f"recipe={recipe}", f"output_dir={tmp_path}", "online.prompts=heldout", *extra])
    assert cfg.model._target_ == "diffalign.models.flux.FluxPolicy.from_pretrained"
    assert cfg.model.pretrained_model_name_or_path == "black-forest-labs/FLUX.1-dev"
    assert (cfg.model.height, cfg.model.width, cfg.model.torch_dtype) == (512, 512, "bfloat16")
    validate_train_config(cfg)
    if recipe == "flow_grpo_flux_pickscore":
        assert cfg.sampler.guidance_scale == 3.5 and cfg.sampler.num_inference_steps == 6
        assert noise_scale(cfg.sampler) == 0.9 and cfg.method.beta_kl == 0 and cfg.online.group_size == 24
    elif recipe == "vipo_flux":
        assert cfg.model.flow_shift == 3.0 and cfg.sampler.name == "dance_sde" and noise_scale(cfg.sampler) == 0.3
        assert cfg.online.group_size == 12 and cfg.online.shared_initial_noise and cfg.method.timestep_fraction == 0.6
    else:
        assert cfg.model.guidance == 3.5 and cfg.sampler.guidance_scale == 1.0 and cfg.method.beta == 1.0
