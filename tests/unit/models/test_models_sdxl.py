"""The SDXL policy on the tiny random SDXL-architecture model: its conditioning against `StableDiffusionXLPipeline`'s
own (`encode_prompt`, `_get_add_time_ids`, the full denoising loop), its LoRA file against
`StableDiffusionXLPipeline.load_lora_weights`, loading from a local folder, and a training step of every method that
applies to an ε/v model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import CHILD_ENV, compose_cfg, online_overrides, perturb_lora_, smoke_overrides, step_sampler
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from safetensors.torch import load_file

from diffalign.models.base import DiffusionPolicy
from diffalign.models.sdxl import StableDiffusionXLPolicy
from diffalign.models.tiny_sdxl import build_tiny_sdxl_pipeline, build_tiny_sdxl_policy

PROMPTS = ["a red circle", "two blue squares above a green triangle"]


@pytest.fixture(scope="module")
def policy():
    policy = build_tiny_sdxl_policy(seed=0)
    perturb_lora_(policy)
    return policy


def _pipeline_of(policy, **overrides) -> StableDiffusionXLPipeline:
    """A plain diffusers SDXL pipeline on the policy's modules (its own scheduler unless overridden)."""
    components = {"vae": policy.vae, "text_encoder": policy.text_encoder, "text_encoder_2": policy.text_encoder_2,
                  "tokenizer": policy.pipe.tokenizer, "tokenizer_2": policy.pipe.tokenizer_2, "unet": policy.unet,
                  "scheduler": policy.pipe.scheduler, "add_watermarker": False, **overrides}
    pipe = StableDiffusionXLPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------- conditioning


def test_tiny_sdxl_is_an_sdxl_architecture_policy(policy):
    assert isinstance(policy, DiffusionPolicy) and not policy.flow_matching and policy.modality == "image"
    assert policy.latent_shape == (4, 8, 8) and policy.vae_scale_factor == 4 and policy.prediction_type == "epsilon"
    assert policy.unet.config.addition_embed_type == "text_time"
    assert policy.unet.config.cross_attention_dim == (policy.text_encoder.config.hidden_size
                                                      + policy.text_encoder_2.config.hidden_size)
    assert isinstance(policy.scheduler, DDIMScheduler) and policy.scheduler.config.beta_schedule == "scaled_linear"


@pytest.mark.parametrize(("original", "crop", "target", "size"), [
    (None, (0, 0), None, (32, 32)),          # the pipeline's defaults: original = target = the image size
    (None, (0, 0), None, (32, 48)),          # height, width order
    ((1024, 768), (16, 8), (512, 512), (32, 32)),
])
def test_add_time_ids_equal_the_pipelines(policy, original, crop, target, size):
    pol = StableDiffusionXLPolicy(build_tiny_sdxl_pipeline(), original_size=original, crops_coords_top_left=crop,
                                  target_size=target) if original else policy
    expected = policy.pipe._get_add_time_ids(original or size, crop, target or size, dtype=torch.float32,
                                             text_encoder_projection_dim=policy.text_encoder_2.config.projection_dim)
    assert torch.equal(pol.add_time_ids(*size), expected)


def test_embeddings_are_both_encoders_penultimate_states_and_the_second_encoders_pooled_output(policy):
    """Derived from the transformers encoders themselves: token embeddings = hidden_states[-2] of both encoders
    concatenated on the feature dim; pooled = CLIPTextModelWithProjection's text_embeds; n images per prompt repeat
    each row in place; SDXL-base's negatives without a negative prompt are zeros (force_zeros_for_empty_prompt)."""
    embeds = policy.encode_prompts(PROMPTS, num_images_per_prompt=2)
    ids = policy.pipe.tokenizer(PROMPTS, padding="max_length", max_length=policy.pipe.tokenizer.model_max_length,
                                truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        one = policy.text_encoder(ids, output_hidden_states=True)
        two = policy.text_encoder_2(ids, output_hidden_states=True)
    tokens = torch.cat([one.hidden_states[-2], two.hidden_states[-2]], dim=-1).repeat_interleave(2, dim=0)
    torch.testing.assert_close(embeds.prompt_embeds, tokens, rtol=0, atol=0)
    torch.testing.assert_close(embeds.pooled_prompt_embeds, two.text_embeds.repeat_interleave(2, dim=0), rtol=0, atol=0)
    assert embeds.negative_prompt_embeds.shape == tokens.shape and not embeds.negative_prompt_embeds.any()
    assert not embeds.negative_pooled_prompt_embeds.any()


def test_encode_prompts_equals_the_pipelines_encode_prompt_with_negatives(policy):
    embeds = policy.encode_prompts(PROMPTS, negative_prompts=["blurry"], num_images_per_prompt=3)
    expected = policy.pipe.encode_prompt(PROMPTS, num_images_per_prompt=3, do_classifier_free_guidance=True,
                                         negative_prompt=["blurry", "blurry"])
    for got, want in zip((embeds.prompt_embeds, embeds.negative_prompt_embeds, embeds.pooled_prompt_embeds,
                          embeds.negative_pooled_prompt_embeds), expected):
        assert torch.equal(got, want)
    assert embeds.negative_prompt_embeds.any()  # a real negative prompt is encoded, not zeroed
    plain = policy.encode_prompts(PROMPTS, do_classifier_free_guidance=False)
    assert plain.negative_prompt_embeds is None and plain.negative_pooled_prompt_embeds is None


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_guided_ddim_rollout_equals_the_sdxl_pipelines_own_sampling(prediction_type):
    """The whole conditioning path (token + pooled embeddings, time ids, CFG order over all three, ε or v) against
    `StableDiffusionXLPipeline.__call__` with the same DDIM schedule and initial latents."""
    from diffalign.samplers.rollout import rollout

    policy = build_tiny_sdxl_policy(seed=1, prediction_type=prediction_type)
    perturb_lora_(policy)
    latents = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
    pipe = _pipeline_of(policy, scheduler=DDIMScheduler.from_config(policy.scheduler.config))
    with torch.no_grad():
        expected = pipe(prompt=PROMPTS, num_inference_steps=4, guidance_scale=3.0, latents=latents.clone(),
                        output_type="latent").images
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=3.0, noise=0.0),
                   latents=latents.clone(), decode=False)
    torch.testing.assert_close(traj.latents[:, -1], expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected, latents, atol=1e-2)


def test_v_prediction_targets_the_velocity():
    policy = build_tiny_sdxl_policy(prediction_type="v_prediction")
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    t = torch.tensor([100, 900])
    abar = policy.scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(policy.training_target(x0, noise, t), abar.sqrt() * noise - (1 - abar).sqrt() * x0)
    torch.testing.assert_close(policy.add_noise(x0, noise, t), abar.sqrt() * x0 + (1 - abar).sqrt() * noise)


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for checkpointing in (False, True):
        pol = StableDiffusionXLPolicy(build_tiny_sdxl_pipeline(seed=0), gradient_checkpointing=checkpointing)
        perturb_lora_(pol)
        pol.train()
        x = torch.randn((2, *pol.latent_shape), generator=torch.Generator().manual_seed(0))
        pol.predict(x, torch.tensor([10, 900]), pol.encode_prompts(PROMPTS), guidance_scale=2.0).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pol.trainable_parameters()]))
    assert pol.unet.is_gradient_checkpointing and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_an_fp16_sdxl_vae_is_kept_float32_and_a_refiner_unet_is_refused():
    pipe = build_tiny_sdxl_pipeline()
    pipe.to(torch.float16)
    pol = StableDiffusionXLPolicy(pipe, lora_rank=2)
    assert pol.vae.dtype == torch.float32 and pol.dtype == torch.float16  # SDXL's VAE overflows in fp16
    assert all(p.dtype == torch.float32 for p in pol.trainable_parameters())
    refiner = build_tiny_sdxl_pipeline()
    refiner.unet.register_to_config(addition_time_embed_dim=4)  # width no longer 6 ids x 8 + 32
    with pytest.raises(ValueError, match="refiner"):
        StableDiffusionXLPolicy(refiner)


# ------------------------------------------------------------------------------------------------------- LoRA, files


def test_lora_is_saved_in_the_diffusers_sdxl_format_and_loads_with_load_lora_weights(policy, tmp_path):
    policy.save_lora_weights(tmp_path)
    keys = load_file(tmp_path / "pytorch_lora_weights.safetensors").keys()
    assert all(k.startswith("unet.") for k in keys) and any(".lora.down.weight" in k for k in keys)
    pipe = build_tiny_sdxl_pipeline(seed=0)  # the same base weights, no adapter
    embeds = policy.encode_prompts(PROMPTS, do_classifier_free_guidance=False)
    x = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(3))
    t = torch.tensor([250, 750])
    time_ids = pipe._get_add_time_ids((32, 32), (0, 0), (32, 32), dtype=torch.float32,
                                      text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim).repeat(2, 1)

    def unet():
        with torch.no_grad():
            return pipe.unet(x, t, encoder_hidden_states=embeds.prompt_embeds, added_cond_kwargs={
                "text_embeds": embeds.pooled_prompt_embeds, "time_ids": time_ids}).sample

    base = unet()
    pipe.load_lora_weights(tmp_path)
    with torch.no_grad():
        ours = policy.predict(x, t, embeds)
    torch.testing.assert_close(unet(), ours, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(base, ours, atol=1e-4)  # the adapter matters


def test_lora_folder_round_trips_and_another_familys_is_refused(policy, tmp_path):
    policy.save_lora_weights(tmp_path / "sdxl")
    fresh = build_tiny_sdxl_policy(seed=0, lora_seed=5)
    fresh.load_lora_weights(tmp_path / "sdxl")
    for a, b in zip(policy.trainable_parameters(), fresh.trainable_parameters(), strict=True):
        assert torch.equal(a, b)
    from diffalign.models.tiny_flow import build_tiny_flow_policy

    build_tiny_flow_policy().save_lora_weights(tmp_path / "sd3")
    with pytest.raises(ValueError, match=r"not for an SDXL UNet"):
        fresh.load_lora_weights(tmp_path / "sd3")


def test_from_pretrained_reads_a_saved_tiny_sdxl_folder_offline(policy, tmp_path, monkeypatch):
    """The real loading path: `StableDiffusionXLPipeline.save_pretrained` then `from_pretrained` on the local folder
    with HF_HUB_OFFLINE=1 (nothing downloaded) gives the same model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    build_tiny_sdxl_pipeline(seed=0).save_pretrained(tmp_path / "tiny_sdxl")
    loaded = StableDiffusionXLPolicy.from_pretrained(str(tmp_path / "tiny_sdxl"), lora_rank=4)
    fresh = build_tiny_sdxl_policy(seed=0)
    embeds = fresh.encode_prompts(PROMPTS)
    x = torch.randn((2, *fresh.latent_shape), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict(x, 500, loaded.encode_prompts(PROMPTS), guidance_scale=2.0),
                                   fresh.predict(x, 500, embeds, guidance_scale=2.0), rtol=0, atol=0)
    with pytest.raises(ValueError, match="model_index.json"):
        StableDiffusionXLPolicy.from_pretrained(str(tmp_path))
    with pytest.raises(OSError):
        StableDiffusionXLPolicy.from_pretrained("diffalign-test/not-a-cached-sdxl")


def test_config_fields_match_the_loaders_signature():
    import dataclasses
    import inspect

    from hydra.utils import get_method

    from diffalign.models.sdxl import StableDiffusionXLPolicyConfig
    from diffalign.models.tiny_sdxl import TinySDXLPolicyConfig

    for config, target in ((StableDiffusionXLPolicyConfig, StableDiffusionXLPolicy.from_pretrained),
                           (TinySDXLPolicyConfig, build_tiny_sdxl_policy)):
        assert {f.name for f in dataclasses.fields(config)} - {"_target_"} == set(
            inspect.signature(target).parameters) - {"cls"}
        assert get_method(config._target_) == target
    cfg = compose_cfg(["model=sdxl"])
    assert cfg.model.pretrained_model_name_or_path == "stabilityai/stable-diffusion-xl-base-1.0"
    assert list(cfg.model.lora_target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]


# -------------------------------------------------------------------------------------- every applicable method


def _lora_moved(run) -> bool:
    """Some LoRA B matrix (zero at initialisation) of the run's final weights is non-zero: the step trained."""
    weights = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    return any(v.abs().max() > 0 for k, v in weights.items() if ".lora.up." in k or ".lora_B." in k)


def _prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a red circle", "two blue squares"]))
    return path


PREFERENCE = {
    "diffusion_dpo": ["method=diffusion_dpo"],
    "sft": ["method=sft", "data=shapes_winners", "data.num_samples=4"],
    "seppo": ["method=seppo", "reference=pool", "data=shapes_winners", "data.num_samples=4", "reference.save_every=1",
              "sampler.num_inference_steps=2"],
    "ddspo": ["method=ddspo", "data=ddspo_pairs", "data.generate=true", "data.num_inference_steps=2",
              "data.guidance_scale=2.0"],
}


@pytest.mark.parametrize("method", sorted(PREFERENCE))
def test_preference_methods_train_on_tiny_sdxl(method, tmp_path):
    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    overrides = smoke_overrides(tmp_path / "run", steps=1) + ["model=tiny_sdxl_random", "data.num_pairs=4"]
    if method != "diffusion_dpo":
        overrides = [o for o in overrides if not o.startswith("data.")]
    if method == "ddspo":
        overrides += [f"data.prompts={_prompts_file(tmp_path)}", f"data.pairs_dir={tmp_path / 'pairs'}"]
    cfg = compose_cfg(overrides + PREFERENCE[method])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["global_step"] == 1
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in results["history_tail"])
    assert _lora_moved(tmp_path / "run")


def test_a_resumed_sdxl_run_ends_with_the_same_weights(tmp_path):
    """Exact resume on SDXL: 2 Diffusion-DPO steps straight, or 1 step, a copy of its checkpoint, and resume=latest."""
    import shutil

    from diffalign.train.preference import train

    def overrides(run, steps):
        return smoke_overrides(tmp_path / run, steps=steps) + ["model=tiny_sdxl_random", "data.num_pairs=4"]

    train(compose_cfg(overrides("a", 2)))
    shutil.copytree(tmp_path / "a" / "checkpoint-1", tmp_path / "b" / "checkpoint-1")
    assert train(compose_cfg(overrides("b", 2) + ["resume=latest"]))["global_step"] == 2
    for name in ("pytorch_lora_weights.safetensors", "optimizer.safetensors"):
        a, b = load_file(tmp_path / "a" / "checkpoint-2" / name), load_file(tmp_path / "b" / "checkpoint-2" / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name


ONLINE = {
    "ddpo": ["method=ddpo", "sampler=ddim", "online.tracker_min_count=2"],
    "dgpo": ["method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=1", "method.timesteps_per_epoch=1"],
    "flow_grpo": ["method=flow_grpo", "sampler=ddim"],
    "vipo": ["method=vipo", "sampler=ddim", "online.shared_initial_noise=true"],
}


@pytest.mark.parametrize("method", sorted(ONLINE))
def test_online_methods_train_on_tiny_sdxl(method, tmp_path):
    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    cfg = compose_cfg(online_overrides(tmp_path, epochs=1) + ONLINE[method] + [
        "model=tiny_sdxl_random", "reward=[brightness]", "online.groups_per_epoch=1", "online.group_size=4",
        "trainer.batch_size=4", "sampler.num_inference_steps=2"])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["rollouts"] == 4
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert history and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert _lora_moved(tmp_path)


def test_flow_only_method_is_refused_on_sdxl(tmp_path):
    from diffalign.train.online import train

    cfg = compose_cfg(online_overrides(tmp_path, epochs=1) + [
        "model=tiny_sdxl_random", "method=diffusion_nft", "sampler=dpm_ode", "sampler.guidance_scale=1",
        "reward=[brightness]"])
    with pytest.raises(ValueError, match="trains rectified-flow .* is an eps/v-prediction model"):
        train(cfg)


@pytest.mark.slow
def test_a_fresh_checkout_trains_tiny_sdxl_from_the_command_line(tmp_path):
    """`diffalign-train model=tiny_sdxl_random` in a child process (offline, nothing downloaded): two Diffusion-DPO
    steps, a checkpoint, and a final LoRA that `StableDiffusionXLPipeline.load_lora_weights` reads."""
    code = "import sys; from diffalign.cli import train; sys.argv = ['diffalign-train'] + sys.argv[1:]; train()"
    args = smoke_overrides(tmp_path / "run", steps=2) + ["model=tiny_sdxl_random", "data.num_pairs=4"]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False,
                         cwd=tmp_path, timeout=600, env={**CHILD_ENV, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["global_step"] == 2 and os.path.isdir(tmp_path / "run" / "checkpoint-2")
    pipe = build_tiny_sdxl_pipeline(seed=0)
    pipe.load_lora_weights(tmp_path / "run" / "final")
    assert _lora_moved(tmp_path / "run")


# ------------------------------------------------------------------------------------------------------- recipes


def test_sdxl_recipes_carry_the_released_hyper_parameters(tmp_path):
    """Values as published: Diffusion-DPO SalesforceAIResearch/DiffusionDPO launchers/sdxl.sh (beta 5000, lr 1e-8
    scaled by the effective batch 2048, 200 warm-up steps, 2000 steps, 1024 px, the fp16-fixed VAE); DDSPO
    KU-MIIL/DDSPO scripts/train_ddspo.sh with MODEL_TYPE=sdxl (beta 16000, lr 2.5e-9 x 2048, linear loss weighting,
    500 steps, 100 warm-up steps; pairs with 25 Euler steps at CFG 7.5)."""
    from diffalign.config.validation import validate_train_config

    prompts = _prompts_file(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"caption": "a red circle", "jpg_0": "a.png", "jpg_1": "b.png", "label_0": 1,
                                 "label_1": 0}) + "\n")
    dpo = compose_cfg(["recipe=diffusion_dpo_sdxl_pickapic", f"data.path={pairs}", f"output_dir={tmp_path / 'a'}"])
    t = dpo.trainer
    assert dpo.model._target_ == "diffalign.models.sdxl.StableDiffusionXLPolicy.from_pretrained"
    assert dpo.model.pretrained_model_name_or_path == "stabilityai/stable-diffusion-xl-base-1.0"
    assert dpo.model.pretrained_vae_model_name_or_path == "madebyollin/sdxl-vae-fp16-fix"
    assert (dpo.method.beta, dpo.data.resolution, t.max_steps, t.lr_warmup_steps) == (5000.0, 1024, 2000, 200)
    assert t.batch_size * t.gradient_accumulation_steps == 2048
    assert t.optimizer.lr == pytest.approx(1e-8 * 2048) and t.lr_scheduler == "constant_with_warmup"
    assert list(dpo.model.lora_target_modules) == ["to_q", "to_k", "to_v", "to_out.0"]
    validate_train_config(dpo)

    ddspo = compose_cfg(["recipe=ddspo_sdxl", "data.generate=true", f"data.prompts={prompts}",
                         f"data.pairs_dir={tmp_path / 'ddspo_pairs'}", f"output_dir={tmp_path / 'b'}"])
    m, d, t = ddspo.method, ddspo.data, ddspo.trainer
    assert (m.beta, m.cpp, m.loss_weighting) == (16000.0, "tf", "linear")
    assert (d.num_inference_steps, d.guidance_scale, d.scheduler) == (25, 7.5, "euler")
    assert (t.max_steps, t.lr_warmup_steps, t.batch_size * t.gradient_accumulation_steps) == (500, 100, 2048)
    assert t.optimizer.lr == pytest.approx(2.5e-9 * 2048)
    assert ddspo.model.gradient_checkpointing and dpo.model.gradient_checkpointing
    validate_train_config(ddspo)
