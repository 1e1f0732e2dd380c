"""DDIM step with log-prob: parity with `DDIMScheduler.step`, the Gaussian log-density, the SD schedule's edge cases
(docs/guides/field_cases.md: the last denoising step, half precision, the DDIM timestep grid)."""

import math

import pytest
import torch
from conftest import sd15_alphas_cumprod_f64
from diffusers import DDIMScheduler

from diffalign.samplers.ddim_logprob import ddim_step, ddim_variance

SHAPE = (2, 4, 8, 8)


def make_scheduler(config, num_steps=50, **overrides):
    scheduler = DDIMScheduler.from_config({**config, **overrides})
    scheduler.set_timesteps(num_steps)
    return scheduler


def reference_mean_std(alphas_cumprod, eps, x, t, num_steps, eta, final_alpha):
    """docs/methods/algorithms.md#ddim-step written out in float64 for ε-prediction."""
    eps, x = eps.double(), x.double()
    prev_t = t - 1000 // num_steps
    a_t = alphas_cumprod[t]
    a_prev = alphas_cumprod[prev_t] if prev_t >= 0 else torch.tensor(final_alpha, dtype=torch.float64)
    x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    std = eta * ((1 - a_prev) / (1 - a_t)).sqrt() * (1 - a_t / a_prev).sqrt()
    mean = a_prev.sqrt() * x0 + (1 - a_prev - std**2).sqrt() * eps
    return mean, std


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- schedule (the last step, the timestep grid)


def test_sd_50_step_timesteps(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    assert scheduler.timesteps.tolist() == list(range(981, 0, -20))
    assert len(scheduler.timesteps) == 50


def test_last_step_variance_sd15(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    variance = ddim_variance(scheduler, 1)
    assert variance.dtype == torch.float32
    assert abs(variance.item() - 4.2635e-4) <= 1e-7
    assert abs(variance.sqrt().item() - 0.020648) <= 1e-6
    # a sampled last step has exactly that std
    out = ddim_step(scheduler, randn(*SHAPE, seed=1), 1, randn(*SHAPE), eta=1.0, generator=torch.Generator())
    assert torch.allclose(out.std, variance.sqrt())
    # vectorised over all timesteps, matching the float64 formula
    ac = sd15_alphas_cumprod_f64()
    t = scheduler.timesteps
    a_prev = torch.where(t - 20 >= 0, ac[(t - 20).clamp(min=0)], ac[0])
    expected = (1 - a_prev) / (1 - ac[t]) * (1 - ac[t] / a_prev)
    torch.testing.assert_close(ddim_variance(scheduler, t).double(), expected, rtol=1e-4, atol=0)


def test_set_alpha_to_one_last_step_is_deterministic_and_finite(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50, set_alpha_to_one=True)
    assert ddim_variance(scheduler, 1).item() == 0.0
    sample, eps = randn(*SHAPE), randn(*SHAPE, seed=1)
    for prev_sample in (None, randn(*SHAPE, seed=2)):
        out = ddim_step(scheduler, eps, 1, sample, eta=1.0, generator=torch.Generator(), prev_sample=prev_sample)
        assert out.std.item() == 0.0
        assert torch.equal(out.log_prob, torch.zeros(2))
        for tensor in (out.prev_sample, out.mean, out.std, out.log_prob):
            assert torch.isfinite(tensor).all()
    # every earlier step is stochastic and finite
    for t in scheduler.timesteps[:-1]:
        out = ddim_step(scheduler, eps, t, sample, eta=1.0, generator=torch.Generator())
        assert out.std.item() > 0 and torch.isfinite(out.log_prob).all()


# ---------------------------------------------------------------- the Gaussian log-density


@pytest.mark.parametrize("step_index", [0, 10, 49])
@pytest.mark.parametrize("given", [False, True])
def test_log_prob_is_normal_log_prob(sd15_ddim_config, step_index, given):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    t = scheduler.timesteps[step_index]
    sample, eps = randn(*SHAPE), randn(*SHAPE, seed=1)
    prev = randn(*SHAPE, seed=2) if given else None
    out_mean = ddim_step(scheduler, eps, t, sample, eta=1.0, generator=torch.Generator(), prev_sample=prev)
    out_sum = ddim_step(
        scheduler, eps, t, sample, eta=1.0, generator=torch.Generator(), prev_sample=prev, reduction="sum"
    )
    assert out_mean.log_prob.shape == (2,) and out_mean.log_prob.dtype == torch.float32
    density = torch.distributions.Normal(out_mean.mean.double(), out_mean.std.double()).log_prob(
        out_mean.prev_sample.double()
    )
    torch.testing.assert_close(out_mean.log_prob.double(), density.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_sum.log_prob.double(), density.sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-3)
    # mean and std against the float64 formula
    mean, std = reference_mean_std(sd15_alphas_cumprod_f64(), eps, sample, int(t), 50, 1.0, final_alpha=0.99915)
    torch.testing.assert_close(out_mean.mean.double(), mean, rtol=1e-4, atol=1e-5)
    assert abs(out_mean.std.item() - std.item()) <= 1e-4 * std.item()


def test_sampled_prev_sample_at_the_mean_scores_the_peak(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    t = scheduler.timesteps[10]
    eps, sample = randn(*SHAPE, seed=1), randn(*SHAPE)
    mean = ddim_step(scheduler, eps, t, sample, eta=1.0, generator=torch.Generator()).mean
    out = ddim_step(scheduler, eps, t, sample, eta=1.0, prev_sample=mean)
    expected = -math.log(out.std.item()) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(out.log_prob, torch.full((2,), expected), rtol=1e-6, atol=1e-5)


def test_per_sample_timesteps_match_scalar_calls(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    sample, eps, prev = randn(*SHAPE), randn(*SHAPE, seed=1), randn(*SHAPE, seed=2)
    t = torch.tensor([981, 1])
    out = ddim_step(scheduler, eps, t, sample, eta=1.0, prev_sample=prev)
    assert out.std.shape == (2, 1, 1, 1)
    for row in range(2):
        single = ddim_step(
            scheduler, eps[row : row + 1], int(t[row]), sample[row : row + 1], eta=1.0, prev_sample=prev[row : row + 1]
        )
        torch.testing.assert_close(out.mean[row], single.mean[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.log_prob[row], single.log_prob[0], rtol=1e-6, atol=1e-6)


def test_gradient_flows_through_mean_only(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    eps = randn(*SHAPE, seed=1).requires_grad_(True)
    prev = randn(*SHAPE, seed=2).requires_grad_(True)
    out = ddim_step(scheduler, eps, 501, randn(*SHAPE), eta=1.0, prev_sample=prev)
    out.log_prob.sum().backward()
    assert eps.grad is not None and eps.grad.abs().sum() > 0
    assert prev.grad is None


# ---------------------------------------------------------------- parity with diffusers


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
@pytest.mark.parametrize("clip_sample", [False, True])
def test_eta0_equals_diffusers_step(sd15_ddim_config, prediction_type, clip_sample):
    ours = make_scheduler(sd15_ddim_config, 50, prediction_type=prediction_type, clip_sample=clip_sample)
    theirs = make_scheduler(sd15_ddim_config, 50, prediction_type=prediction_type, clip_sample=clip_sample)
    sample = randn(*SHAPE)
    for i, t in enumerate(ours.timesteps):
        model_output = randn(*SHAPE, seed=100 + i)
        expected = theirs.step(model_output, t, sample, eta=0.0).prev_sample
        out = ddim_step(ours, model_output, t, sample, eta=0.0)
        assert torch.equal(out.prev_sample, expected), f"step {i} (t={int(t)})"
        assert torch.equal(out.log_prob, torch.zeros(2)) and out.std.item() == 0.0
        sample = expected


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("per_image", [False, True])
def test_eta1_with_same_generator_equals_diffusers_sample(sd15_ddim_config, prediction_type, per_image):
    ours = make_scheduler(sd15_ddim_config, 20, prediction_type=prediction_type)
    theirs = make_scheduler(sd15_ddim_config, 20, prediction_type=prediction_type)

    def generators():
        if per_image:
            return [torch.Generator().manual_seed(s) for s in (3, 4)]
        return torch.Generator().manual_seed(3)

    gen_ours, gen_theirs = generators(), generators()
    sample_ours = sample_theirs = randn(*SHAPE)
    for i, t in enumerate(ours.timesteps):
        model_output = randn(*SHAPE, seed=100 + i)
        sample_theirs = theirs.step(model_output, t, sample_theirs, eta=1.0, generator=gen_theirs).prev_sample
        sample_ours = ddim_step(ours, model_output, t, sample_ours, eta=1.0, generator=gen_ours).prev_sample
        torch.testing.assert_close(sample_ours, sample_theirs, rtol=0, atol=1e-6)


def test_generator_list_of_wrong_length_raises(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    generators = [torch.Generator() for _ in range(3)]
    with pytest.raises(ValueError, match=r"3 generators.*batch of 2"):
        ddim_step(scheduler, randn(*SHAPE), 981, randn(*SHAPE), eta=1.0, generator=generators)


def test_bad_arguments_raise(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    x = randn(*SHAPE)
    with pytest.raises(ValueError, match="reduction"):
        ddim_step(scheduler, x, 981, x, reduction="max")
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_step(scheduler, x, 981, x, prediction_type="flow")
    with pytest.raises(ValueError, match="shape"):
        ddim_step(scheduler, x, 981, x[:1])
    with pytest.raises(ValueError, match="set_timesteps"):
        ddim_step(DDIMScheduler.from_config(sd15_ddim_config), x, 981, x)


# ---------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_fp32_log_prob(sd15_ddim_config, dtype):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    t = scheduler.timesteps[10]
    model_output, sample, prev = (randn(*SHAPE, seed=s).to(dtype) for s in (0, 1, 2))
    out = ddim_step(scheduler, model_output, t, sample, eta=1.0, prev_sample=prev)
    assert out.log_prob.dtype == torch.float32 and out.mean.dtype == torch.float32
    assert torch.isfinite(out.log_prob).all()
    # float64 computation on the upcast inputs, from the formula
    mean, std = reference_mean_std(sd15_alphas_cumprod_f64(), model_output, sample, int(t), 50, 1.0, 0.99915)
    density = torch.distributions.Normal(mean, std).log_prob(prev.double()).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), density, rtol=1e-3, atol=0)
    sampled = ddim_step(scheduler, model_output, t, sample, eta=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.prev_sample.dtype == torch.float32 and torch.isfinite(sampled.log_prob).all()


# ---------------------------------------------------------------- edges found by mutation testing
# (docs/contributing.md#mutation-testing): the messages, the schedule's first step, per-position log-probs, the RNG


def test_every_argument_error_is_one_whole_line(sd15_ddim_config):
    scheduler = make_scheduler(sd15_ddim_config, 50)
    x = randn(*SHAPE)
    with pytest.raises(ValueError, match=r"^`eta` must be >= 0, got -0.5.$"):
        ddim_step(scheduler, x, 981, x, eta=-0.5)
    with pytest.raises(ValueError, match=r"^`prev_sample` shape \(1, 4, 8, 8\) must equal `sample` shape "
                                         r"\(2, 4, 8, 8\).$"):
        ddim_step(scheduler, x, 981, x, eta=1.0, prev_sample=x[:1])
    with pytest.raises(ValueError, match=r"^Got a list of 3 generators for a batch of 2 samples; pass one generator "
                                         r"per sample.$"):
        ddim_step(scheduler, x, 981, x, eta=1.0, generator=[torch.Generator() for _ in range(3)])
    with pytest.raises(ValueError, match=r"^`timestep` must be a scalar or have shape \(B,\), got shape \(2, 1\).$"):
        ddim_step(scheduler, x, torch.tensor([[981], [961]]), x)
    with pytest.raises(ValueError, match=r"^`scheduler.num_inference_steps` is None: call "
                                         r"`scheduler.set_timesteps\(N\)` before stepping.$"):
        ddim_variance(DDIMScheduler.from_config(sd15_ddim_config), 981)
    thresholding = make_scheduler(sd15_ddim_config, 50, thresholding=True)
    with pytest.raises(ValueError, match=r"^`scheduler.config.thresholding=True` is not supported by `ddim_step`; "
                                         r"set it to False.$"):
        ddim_step(thresholding, x, 981, x)


def test_a_step_onto_timestep_zero_uses_its_alpha_not_the_final_one(sd15_ddim_config):
    """With ``steps_offset=0`` the 50-step grid is 980, ..., 20, 0: the step from t = 20 lands on t' = 0, whose ᾱ_0 is
    the schedule's (0.99915), not `final_alpha_cumprod` (1 with ``set_alpha_to_one=True``); eq. 16 in float64."""
    scheduler = make_scheduler(sd15_ddim_config, 50, steps_offset=0, set_alpha_to_one=True)
    assert scheduler.timesteps[-2:].tolist() == [20, 0]
    ac = sd15_alphas_cumprod_f64()
    expected = (1 - ac[0]) / (1 - ac[20]) * (1 - ac[20] / ac[0])
    assert ddim_variance(scheduler, 20).item() == pytest.approx(expected.item(), rel=1e-4)
    assert ddim_variance(scheduler, 0).item() == 0.0  # the last step: t' < 0, ᾱ = 1


def test_float64_schedules_still_give_float32(sd15_ddim_config):
    """`DDIMStepOutput`: every tensor is float32, also when the scheduler's ᾱ were cast to float64."""
    scheduler = make_scheduler(sd15_ddim_config, 50)
    scheduler.alphas_cumprod = scheduler.alphas_cumprod.double()
    scheduler.final_alpha_cumprod = scheduler.final_alpha_cumprod.double()
    out = ddim_step(scheduler, randn(*SHAPE, seed=1), 1, randn(*SHAPE), eta=1.0, generator=torch.Generator())
    assert {t.dtype for t in (out.prev_sample, out.mean, out.std, out.log_prob)} == {torch.float32}
    assert ddim_variance(scheduler, 1).dtype == torch.float32


def test_per_position_log_prob_sums_the_channels_only(sd15_ddim_config):
    """ViPO's per-position log-prob `(B, h, w)`: Σ_c log N(x'_c; μ_c, s²), from torch.distributions."""
    scheduler = make_scheduler(sd15_ddim_config, 50)
    t = scheduler.timesteps[10]
    eps, x, prev = randn(*SHAPE, seed=1), randn(*SHAPE), randn(*SHAPE, seed=2)
    out = ddim_step(scheduler, eps, t, x, eta=1.0, prev_sample=prev, reduction="per_position")
    assert out.log_prob.shape == (2, 8, 8)
    expected = torch.distributions.Normal(out.mean, out.std).log_prob(prev).sum(dim=1)
    torch.testing.assert_close(out.log_prob, expected)
    summed = ddim_step(scheduler, eps, t, x, eta=1.0, prev_sample=prev, reduction="sum")
    torch.testing.assert_close(out.log_prob.sum(dim=(1, 2)), summed.log_prob, rtol=1e-5, atol=1e-3)


def test_a_deterministic_step_draws_no_noise(sd15_ddim_config):
    """η = 0 (also the default) draws nothing from the generator, as `DDIMScheduler.step(eta=0)`: a rollout's later
    stochastic steps see the same random stream."""
    scheduler = make_scheduler(sd15_ddim_config, 50)
    eps, x = randn(*SHAPE, seed=1), randn(*SHAPE)
    generator = torch.Generator().manual_seed(7)
    state = generator.get_state()
    default = ddim_step(scheduler, eps, 981, x, generator=generator)
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(default.prev_sample, default.mean) and torch.equal(default.log_prob, torch.zeros(2))


def test_half_precision_noise_is_drawn_in_half_as_diffusers_does(sd15_ddim_config):
    """diffusers draws the step noise with `randn_tensor` in the model output's dtype: for fp16 that is the float32
    draw rounded to half, which moves x_{t'} by up to ~1e-3·s."""
    scheduler = make_scheduler(sd15_ddim_config, 50)
    eps, x = randn(*SHAPE, seed=1, dtype=torch.float16), randn(*SHAPE, dtype=torch.float16)
    out = ddim_step(scheduler, eps, 501, x, eta=1.0, generator=torch.Generator().manual_seed(3))
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)).half().float()
    assert torch.equal(out.prev_sample, out.mean + out.std * noise)
    full = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(out.prev_sample, out.mean + out.std * full)
