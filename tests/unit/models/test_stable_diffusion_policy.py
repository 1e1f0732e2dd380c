"""StableDiffusionPolicy on the tiny random SD pipeline: trainable parameters in fp32, CFG batch order, prompt
expansion (docs/guides/field_cases.md), the adapter-disabled reference, LoRA save/load through diffusers, loading from
a folder."""

import dataclasses
import inspect

import pytest
import torch
from conftest import sd15_alphas_cumprod_f64, step_sampler
from diffusers import DDIMScheduler, StableDiffusionPipeline
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf

from diffalign.models.base import DiffusionPolicy
from diffalign.models.stable_diffusion import StableDiffusionPolicy, StableDiffusionPolicyConfig, cfg_batch
from diffalign.models.tiny_random import (
    TinyRandomPolicyConfig,
    build_tiny_random_pipeline,
    build_tiny_random_policy,
)
from diffalign.samplers.rollout import rollout
from diffalign.types import PromptEmbeds

PROMPTS = ["a red circle", "two blue squares"]


def latents_and_t(batch=2, seed=0):
    return torch.randn(batch, 4, 8, 8, generator=torch.Generator().manual_seed(seed)), torch.tensor(501)


# ---------------------------------------------------------------- construction


def test_tiny_policy_trains_only_fp32_lora(tiny_policy):
    params = tiny_policy.trainable_parameters()
    named = {n: p for n, p in tiny_policy.named_parameters() if p.requires_grad}
    assert params and len(params) == len(named)
    assert all("lora_" in name for name in named)
    assert all(p.dtype == torch.float32 for p in params)
    assert not any(p.requires_grad for p in tiny_policy.vae.parameters())
    assert not any(p.requires_grad for p in tiny_policy.text_encoder.parameters())
    assert tiny_policy.prediction_type == "epsilon"
    assert tiny_policy.latent_shape == (4, 8, 8) and tiny_policy.vae_scale_factor == 4
    assert tiny_policy.device == torch.device("cpu") and tiny_policy.dtype == torch.float32
    assert isinstance(tiny_policy.scheduler, DDIMScheduler)


def test_tiny_build_is_deterministic_and_keeps_global_rng():
    state = torch.get_rng_state()
    a, b = build_tiny_random_pipeline(seed=0), build_tiny_random_pipeline(seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    for name in ("vae", "unet", "text_encoder"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    c = build_tiny_random_pipeline(seed=1)
    assert not torch.equal(a.unet.conv_in.weight, c.unet.conv_in.weight)


@pytest.mark.parametrize("lora_rank", [4, None])
def test_trainable_params_are_fp32_when_frozen_parts_are_half(lora_rank):
    pipe = build_tiny_random_pipeline()
    pipe.to(torch.float16)
    policy = StableDiffusionPolicy.from_pipeline(pipe, lora_rank=lora_rank)
    params = policy.trainable_parameters()
    assert params and all(p.dtype == torch.float32 for p in params)
    assert policy.vae.dtype == torch.float16 and policy.text_encoder.dtype == torch.float16
    if lora_rank is None:
        assert len(params) == len(list(policy.unet.parameters()))


def test_v_prediction_policy_and_training_targets(sd15_ddim_config):
    pipe = build_tiny_random_pipeline()
    pipe.scheduler = DDIMScheduler.from_config({**sd15_ddim_config, "prediction_type": "v_prediction"})
    policy = StableDiffusionPolicy.from_pipeline(pipe)
    assert policy.prediction_type == "v_prediction"
    x0, t = latents_and_t()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([10, 900])
    a = sd15_alphas_cumprod_f64()[t].view(-1, 1, 1, 1)
    expected_xt = a.sqrt() * x0.double() + (1 - a).sqrt() * noise.double()
    expected_v = a.sqrt() * noise.double() - (1 - a).sqrt() * x0.double()
    torch.testing.assert_close(policy.add_noise(x0, noise, t).double(), expected_xt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(policy.training_target(x0, noise, t).double(), expected_v, rtol=1e-5, atol=1e-5)
    eps_policy = build_tiny_random_policy()
    assert torch.equal(eps_policy.training_target(x0, noise, t), noise)


def test_unsupported_prediction_type_and_rank_raise(sd15_ddim_config):
    pipe = build_tiny_random_pipeline()
    pipe.scheduler = DDIMScheduler.from_config({**sd15_ddim_config, "prediction_type": "sample"})
    with pytest.raises(ValueError, match="prediction_type"):
        StableDiffusionPolicy.from_pipeline(pipe)
    with pytest.raises(ValueError, match="lora_rank"):
        build_tiny_random_policy(lora_rank=0)


# ---------------------------------------------------------------- prompts and CFG


def test_cfg_batch_is_negative_then_positive_for_tokens_and_pooled():
    embeds = PromptEmbeds(
        prompt_embeds=torch.ones(2, 77, 32),
        negative_prompt_embeds=torch.zeros(2, 77, 32),
        pooled_prompt_embeds=torch.ones(2, 32),
        negative_pooled_prompt_embeds=torch.zeros(2, 32),
    )
    tokens, pooled = cfg_batch(embeds), cfg_batch(embeds, pooled=True)
    assert tokens.shape == (4, 77, 32) and pooled.shape == (4, 32)
    assert (tokens[:2] == 0).all() and (tokens[2:] == 1).all()
    assert (pooled[:2] == 0).all() and (pooled[2:] == 1).all()
    with pytest.raises(ValueError, match="negative"):
        cfg_batch(PromptEmbeds(torch.ones(2, 77, 32)))


def test_guidance_one_is_exactly_the_conditional_output(tiny_policy):
    latents, t = latents_and_t()
    embeds = tiny_policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        out = tiny_policy.predict(latents, t, embeds, guidance_scale=1.0)
        cond = tiny_policy.unet(latents, t, encoder_hidden_states=embeds.prompt_embeds).sample
        uncond = tiny_policy.unet(latents, t, encoder_hidden_states=embeds.negative_prompt_embeds).sample
        guided = tiny_policy.predict(latents, t, embeds, guidance_scale=7.5)
    assert out.dtype == torch.float32 and torch.equal(out, cond)
    torch.testing.assert_close(guided, uncond + 7.5 * (cond - uncond), rtol=0, atol=1e-5)
    assert (guided - cond).abs().max() > 1e-3
    with pytest.raises(ValueError, match="guidance_scale"):
        tiny_policy.predict(latents, t, embeds, guidance_scale=0.5)


def test_per_sample_timesteps_in_predict(tiny_policy):
    latents, _ = latents_and_t()
    embeds = tiny_policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        both = tiny_policy.predict(latents, torch.tensor([101, 801]), embeds, guidance_scale=3.0)
        first = tiny_policy.predict(latents[:1], torch.tensor(101), embeds.index(slice(0, 1)), guidance_scale=3.0)
    torch.testing.assert_close(both[:1], first, rtol=0, atol=1e-5)


def test_encode_prompts_expands_rows_per_prompt_and_negatives_alike(tiny_policy):
    negatives = ["a green triangle", "a yellow square"]
    embeds = tiny_policy.encode_prompts(PROMPTS, negatives, num_images_per_prompt=3)
    assert embeds.prompt_embeds.shape == (6, 12, 32) and embeds.negative_prompt_embeds.shape == (6, 12, 32)
    single = tiny_policy.encode_prompts(PROMPTS + negatives, do_classifier_free_guidance=False).prompt_embeds
    assert tiny_policy.encode_prompts(PROMPTS, do_classifier_free_guidance=False).negative_prompt_embeds is None
    for row, src in enumerate([0, 0, 0, 1, 1, 1]):
        torch.testing.assert_close(embeds.prompt_embeds[row], single[src], rtol=0, atol=1e-6)
        torch.testing.assert_close(embeds.negative_prompt_embeds[row], single[2 + src], rtol=0, atol=1e-6)
    broadcast = tiny_policy.encode_prompts(PROMPTS, negatives[:1], num_images_per_prompt=3)
    torch.testing.assert_close(broadcast.negative_prompt_embeds[5], single[2], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        tiny_policy.encode_prompts(PROMPTS, negatives + ["a blue circle"])
    with pytest.raises(ValueError, match="list of strings"):
        tiny_policy.encode_prompts("a red circle")


def test_default_negative_is_the_empty_prompt_as_in_diffusers(tiny_policy):
    embeds = tiny_policy.encode_prompts(PROMPTS)
    theirs, negative = tiny_policy.to_pipeline().encode_prompt(PROMPTS, "cpu", 1, True)
    assert torch.equal(embeds.prompt_embeds, theirs) and torch.equal(embeds.negative_prompt_embeds, negative)


# ---------------------------------------------------------------- reference (adapter disabled)


def test_reference_is_the_base_unet_and_restores_the_adapter(tiny_policy):
    latents, t = latents_and_t()
    embeds = tiny_policy.encode_prompts(PROMPTS)
    base_unet = build_tiny_random_pipeline(seed=0).unet
    with torch.no_grad():
        adapted = tiny_policy.predict(latents, t, embeds, guidance_scale=3.0)
        with tiny_policy.reference():
            reference = tiny_policy.predict(latents, t, embeds, guidance_scale=3.0)
        base = base_unet(torch.cat([latents] * 2), t, encoder_hidden_states=cfg_batch(embeds)).sample
        uncond, cond = base.chunk(2)
        assert torch.equal(reference, uncond + 3.0 * (cond - uncond))
        assert (adapted - reference).abs().max() > 1e-3
        assert torch.equal(tiny_policy.predict(latents, t, embeds, guidance_scale=3.0), adapted)
        with pytest.raises(RuntimeError, match="boom"), tiny_policy.reference():
            raise RuntimeError("boom")
        assert torch.equal(tiny_policy.predict(latents, t, embeds, guidance_scale=3.0), adapted)


def test_reference_switches_the_same_layers_as_diffusers_and_follows_a_new_adapter(tiny_policy, monkeypatch):
    """`reference` toggles the tuner layers itself (no package-metadata check per switch): inside it every LoRA
    layer is off and no adapter tensor requires grad, as after diffusers' `disable_adapters`; afterwards the flags are
    those diffusers' `enable_adapters` leaves, also with a second adapter (a reference strategy's) added after the
    first switch."""
    from diffusers.loaders.peft import PeftAdapterMixin
    from peft.tuners.tuners_utils import BaseTunerLayer

    from diffalign.reference.adapter import ReferenceAdapter

    unet = tiny_policy.unet

    def state():
        layers = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]
        return [m.disable_adapters for m in layers], {n: p.requires_grad for n, p in unet.named_parameters()}

    with tiny_policy.reference():  # a first switch (the layers are found), then a second adapter
        pass
    ReferenceAdapter(tiny_policy, adapter_name="old")
    unet.disable_adapters()
    want_inside = state()
    unet.enable_adapters()
    want_after = state()
    monkeypatch.setattr(PeftAdapterMixin, "disable_adapters", lambda self: pytest.fail("diffusers' switch called"))
    monkeypatch.setattr(PeftAdapterMixin, "enable_adapters", lambda self: pytest.fail("diffusers' switch called"))
    with tiny_policy.reference():
        assert state() == want_inside and all(want_inside[0])
    assert state() == want_after and not any(want_after[0])


def test_reference_without_lora_explains_the_frozen_copy():
    policy = build_tiny_random_policy(lora_rank=None)
    with pytest.raises(ValueError, match="frozen-copy reference"), policy.reference():
        pass


# ---------------------------------------------------------------- LoRA files


def test_saved_lora_loads_into_a_fresh_diffusers_pipeline(tmp_path, perturb_lora):
    policy = build_tiny_random_policy(lora_rank=4, lora_alpha=8)  # alpha != rank: the file must carry the scale
    perturb_lora(policy)
    policy.save_lora_weights(tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    kwargs = {"num_inference_steps": 4, "guidance_scale": 4.0, "eta": 0.0}
    ours = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=4.0, noise=0.0),
                   generator=[torch.Generator().manual_seed(s) for s in (0, 1)]).images

    fresh = build_tiny_random_pipeline(seed=0)
    pipe = StableDiffusionPipeline(**fresh.components)
    pipe.set_progress_bar_config(disable=True)
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    without = pipe(PROMPTS, generator=gens, output_type="pt", **kwargs).images
    assert (without - ours).abs().max() > 1e-3  # the LoRA changes the images, so the next check can fail
    pipe.load_lora_weights(tmp_path)
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    theirs = pipe(PROMPTS, generator=gens, output_type="pt", **kwargs).images
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_lora_round_trip_into_a_policy(tmp_path, tiny_policy):
    tiny_policy.save_lora_weights(tmp_path)
    restored = build_tiny_random_policy()
    restored.load_lora_weights(tmp_path)
    saved, loaded = tiny_policy.lora_state_dict(), restored.lora_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in restored.trainable_parameters())
    with pytest.raises(ValueError, match="lora_rank"):
        build_tiny_random_policy(lora_rank=2).load_lora_weights(tmp_path)
    with pytest.raises(ValueError, match="pytorch_lora_weights"):
        restored.load_lora_weights(tmp_path / "missing")


# ---------------------------------------------------------------- VAE


def test_decode_matches_pipeline_and_encode_images(tiny_policy):
    latents, _ = latents_and_t()
    with torch.no_grad():
        images = tiny_policy.decode(latents)
        pipe = tiny_policy.to_pipeline()
        expected = pipe.image_processor.postprocess(
            pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample, output_type="pt"
        )
        encoded = tiny_policy.encode_images(images)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert torch.equal(images, expected)
    assert encoded.shape == (2, 4, 8, 8) and encoded.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(tiny_policy.encode_images(images), encoded)  # the mean, not a sample
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tiny_policy.encode_images(images * 255)


# ---------------------------------------------------------------- loading from a folder, configs


def test_from_pretrained_local_folder(tmp_path, tiny_policy):
    build_tiny_random_pipeline(seed=0).save_pretrained(tmp_path / "tiny")
    loaded = StableDiffusionPolicy.from_pretrained(str(tmp_path / "tiny"), local_files_only=True, lora_seed=0)
    fresh = build_tiny_random_policy(seed=0)
    latents, t = latents_and_t()
    embeds = fresh.encode_prompts(PROMPTS)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.predict(latents, t, embeds, 4.0), fresh.predict(latents, t, embeds, 4.0), rtol=0, atol=1e-6
        )
    half = StableDiffusionPolicy.from_pretrained(str(tmp_path / "tiny"), torch_dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in half.trainable_parameters())


def test_from_pretrained_bad_arguments_raise_before_loading(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"does not exist.*model\.pretrained"):
        StableDiffusionPolicy.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model_index.json"):
        StableDiffusionPolicy.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="torch_dtype"):
        StableDiffusionPolicy.from_pretrained(str(tmp_path), torch_dtype="fp8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id that is not cached fails without touching the network
    with pytest.raises(OSError):
        StableDiffusionPolicy.from_pretrained("diffalign-test/not-a-cached-model")


@pytest.mark.parametrize(
    ("config", "target"),
    [
        (StableDiffusionPolicyConfig, StableDiffusionPolicy.from_pretrained),
        (TinyRandomPolicyConfig, build_tiny_random_policy),
    ],
)
def test_config_fields_match_signature(config, target):
    fields = {f.name for f in dataclasses.fields(config)} - {"_target_"}
    assert fields == set(inspect.signature(target).parameters) - {"cls"}
    assert get_method(config._target_) == target


def test_tiny_config_instantiates_a_diffusion_policy():
    policy = instantiate(OmegaConf.structured(TinyRandomPolicyConfig(lora_rank=2)))
    assert isinstance(policy, StableDiffusionPolicy) and isinstance(policy, DiffusionPolicy)
    assert policy.lora_rank == 2 and policy.unet.peft_config["default"].r == 2
