"""The rollout loop: trajectory bookkeeping, the on-policy ratio, parity with `StableDiffusionPipeline`, per-image
generators and deterministic last steps (docs/guides/field_cases.md)."""

import pytest
import torch
from conftest import step_sampler
from diffusers import DDIMScheduler

from diffalign.samplers.rollout import recompute_log_probs, rollout

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow square", "a blue circle"]


def generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_trajectory_stores_every_step_with_its_timestep_and_next_latent(tiny_policy):
    trajectory = rollout(tiny_policy, PROMPTS[:2],
                         step_sampler(tiny_policy, num_inference_steps=50, guidance_scale=4.0, noise=1.0),
                         generator=generators([0, 1]))
    assert trajectory.latents.shape == (2, 51, 4, 8, 8) and trajectory.latents.dtype == torch.float32
    assert trajectory.next_latents.shape == (2, 50, 4, 8, 8)
    for k in range(50):
        assert torch.equal(trajectory.next_latents[:, k], trajectory.latents[:, k + 1])
    assert trajectory.log_probs.shape == (2, 50) and trajectory.log_probs.dtype == torch.float32
    assert torch.isfinite(trajectory.log_probs).all()
    assert trajectory.timesteps.tolist() == list(range(981, 0, -20))
    assert torch.equal(trajectory.timesteps, tiny_policy.scheduler.timesteps)
    assert trajectory.trainable.shape == (50,) and trajectory.trainable.all()
    assert trajectory.images.shape == (2, 3, 32, 32) and trajectory.images.dtype == torch.float32
    assert 0 <= trajectory.images.min() and trajectory.images.max() <= 1
    assert trajectory.prompts == PROMPTS[:2] and trajectory.guidance_scale == 4.0 and trajectory.noise == 1.0
    assert not trajectory.latents.requires_grad


def test_recomputed_log_probs_give_ratio_one_with_cfg(tiny_policy):
    trajectory = rollout(tiny_policy, PROMPTS,
                         step_sampler(tiny_policy, num_inference_steps=10, guidance_scale=5.0, noise=1.0),
                         generator=generators(range(4)))
    steps = [0, 4, 9]
    new = recompute_log_probs(tiny_policy, trajectory, steps)
    assert new.shape == (4, 3)
    ratio = torch.exp(new - trajectory.log_probs[:, steps])
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    # gradients reach the LoRA parameters, and only through the recomputation
    new.sum().backward()
    grads = [p.grad for p in tiny_policy.trainable_parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0


def test_recompute_after_another_rollout_resets_the_schedule(tiny_policy):
    trajectory = rollout(tiny_policy, PROMPTS[:2], step_sampler(tiny_policy, num_inference_steps=4, noise=1.0),
                         generator=generators([0, 1]))
    rollout(tiny_policy, PROMPTS[:2], step_sampler(tiny_policy, num_inference_steps=7, noise=1.0), decode=False)
    with torch.no_grad():
        new = recompute_log_probs(tiny_policy, trajectory, range(4))
    torch.testing.assert_close(new, trajectory.log_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_matches_diffusers_pipeline(tiny_policy, eta):
    kwargs = {"num_inference_steps": 8, "guidance_scale": 4.0, "eta": eta}
    sampler = step_sampler(tiny_policy, num_inference_steps=8, guidance_scale=4.0, noise=eta)
    trajectory = rollout(tiny_policy, PROMPTS, sampler, generator=generators([10, 11, 12, 13]))
    pipe = tiny_policy.to_pipeline()
    assert isinstance(pipe.scheduler, DDIMScheduler)
    expected = pipe(PROMPTS, generator=generators([10, 11, 12, 13]), output_type="pt", **kwargs).images
    torch.testing.assert_close(trajectory.images, expected, rtol=0, atol=1e-5)
    # and the adapter matters, so the comparison above could fail
    with tiny_policy.reference():
        base = rollout(tiny_policy, PROMPTS, sampler, generator=generators([10, 11, 12, 13]))
    assert (base.images - expected).abs().max() > 1e-3


def test_per_image_generators_reproduce_one_image_alone(tiny_policy):
    prompts = ["a red square"] * 4
    batch = rollout(tiny_policy, prompts,
                    step_sampler(tiny_policy, num_inference_steps=2, guidance_scale=4.0, noise=1.0),
                    generator=generators([10, 11, 12, 13]))
    alone = rollout(tiny_policy, prompts[:1],
                    step_sampler(tiny_policy, num_inference_steps=2, guidance_scale=4.0, noise=1.0),
                    generator=generators([12]))
    # the noise that seeds image 2 is bitwise that of the lone run
    assert torch.equal(batch.latents[2, 0], alone.latents[0, 0])
    # the UNet output is batch-size dependent at the last bits on CPU (MKL picks a different GEMM kernel for 2 rows
    # than for 8), so the images agree to float32 rounding rather than bitwise
    torch.testing.assert_close(batch.images[2], alone.images[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(batch.latents[2], alone.latents[0], rtol=0, atol=1e-5)
    assert (batch.images[1] - alone.images[0]).abs().max() > 1e-3  # other seeds give other images


def test_per_image_step_noise_does_not_depend_on_the_batch(sd15_ddim_config):
    """With a model-free step (fixed model output), the whole chain of image k is bitwise that of a lone run."""
    from diffalign.samplers.ddim_logprob import ddim_step

    scheduler = DDIMScheduler.from_config(sd15_ddim_config)
    scheduler.set_timesteps(5)

    def chain(seeds):
        gens = generators(seeds)
        x = torch.cat([torch.randn(1, 4, 8, 8, generator=g) for g in gens])
        for t in scheduler.timesteps:
            x = ddim_step(scheduler, torch.full_like(x, 0.1), t, x, eta=1.0, generator=gens).prev_sample
        return x

    assert torch.equal(chain([10, 11, 12, 13])[2], chain([12])[0])


def test_wrong_generator_list_length_raises(tiny_policy):
    with pytest.raises(ValueError, match=r"3 generators for 4 prompts"):
        rollout(tiny_policy, PROMPTS, step_sampler(tiny_policy, num_inference_steps=2), generator=generators([0, 1, 2]))


def test_bad_arguments_raise(tiny_policy):
    with pytest.raises(ValueError, match="num_inference_steps.*got 0"):
        rollout(tiny_policy, PROMPTS, step_sampler(tiny_policy, num_inference_steps=0))
    with pytest.raises(ValueError, match="latents"):
        rollout(tiny_policy, PROMPTS, step_sampler(tiny_policy, num_inference_steps=1), latents=torch.zeros(4, 4, 4, 4))
    embeds = tiny_policy.encode_prompts(PROMPTS[:2])
    with pytest.raises(ValueError, match="prompt_embeds"):
        rollout(tiny_policy, PROMPTS, step_sampler(tiny_policy, num_inference_steps=1), prompt_embeds=embeds)


def test_eta0_trajectory_is_deterministic_and_not_trainable(tiny_policy):
    trajectory = rollout(tiny_policy, PROMPTS[:2], step_sampler(tiny_policy, num_inference_steps=3, noise=0.0),
                         decode=False)
    assert trajectory.images is None
    assert not trajectory.trainable.any() and torch.equal(trajectory.log_probs, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="eta"):
        recompute_log_probs(tiny_policy, trajectory, [0])


def test_final_alpha_one_last_step_is_excluded_and_finite(tiny_policy, sd15_ddim_config):
    tiny_policy.scheduler = DDIMScheduler.from_config({**sd15_ddim_config, "set_alpha_to_one": True})
    trajectory = rollout(tiny_policy, PROMPTS[:2], step_sampler(tiny_policy, num_inference_steps=5, noise=1.0),
                         generator=generators([0, 1]))
    assert trajectory.trainable.tolist() == [True, True, True, True, False]
    assert torch.equal(trajectory.log_probs[:, -1], torch.zeros(2))
    assert torch.isfinite(trajectory.log_probs).all() and torch.isfinite(trajectory.latents).all()
    assert torch.isfinite(trajectory.images).all()


def test_precomputed_embeddings_guidance_one_and_callback(tiny_policy):
    embeds = tiny_policy.encode_prompts(PROMPTS[:2], do_classifier_free_guidance=False)
    seen = []
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    trajectory = rollout(tiny_policy, PROMPTS[:2],
                         step_sampler(tiny_policy, num_inference_steps=3, guidance_scale=1.0, noise=1.0),
                         latents=latents, prompt_embeds=embeds, callback=seen.append)
    assert torch.equal(trajectory.latents[:, 0], latents)
    assert [d["i"] for d in seen] == [0, 1, 2]
    assert set(seen[0]) == {"i", "t", "x", "x_next", "model_output", "mean", "std", "log_prob"}
    assert torch.equal(seen[1]["x_next"], trajectory.latents[:, 2])
    with pytest.raises(ValueError, match="negative"):
        rollout(tiny_policy, PROMPTS[:2], step_sampler(tiny_policy, num_inference_steps=1, guidance_scale=2.0),
                prompt_embeds=embeds)
