"""ViPO (docs/methods/algorithms.md#vipo): per-position log-probs, the Perceptual Structuring Module, advantage maps,
the objective (per-position and scalar-weighted) and the online loop."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import step_sampler

from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.policy_gradient import ClippedPolicyGradient
from diffalign.objectives.vipo import ViPO
from diffalign.samplers.rollout import recompute_step, rollout
from diffalign.vipo.backbones import Dinov2Backbone, TinyClipBackbone, build_backbone
from diffalign.vipo.psm import PerceptualStructuring, advantage_maps, pca_components, smooth_1d, smooth_2d
from diffalign.world.render import render_spec, to_tensor

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow circle", "a blue square"]


def world_images(n: int = 4) -> torch.Tensor:
    specs = [{"tag": "single_object", "include": [{"class": "circle", "count": 1, "color": "red"}]},
             {"tag": "counting", "include": [{"class": "square", "count": 2, "color": "blue"}]},
             {"tag": "two_object", "include": [{"class": "triangle", "count": 1, "color": "green"},
                                               {"class": "circle", "count": 1, "color": "yellow"}]},
             {"tag": "single_object", "include": [{"class": "square", "count": 1, "color": "blue"}]}]
    return to_tensor(__import__("numpy").stack([render_spec(specs[i % 4], seed=i) for i in range(n)]))


def policy_for(family: str):
    if family == "flow":
        return build_tiny_flow_policy(seed=0), 0.7
    return build_tiny_random_policy(seed=0), 1.0


def perturb(policy, scale=0.05):
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


@pytest.mark.parametrize("family", ["flow", "ddim"])
def test_per_position_log_probs_sum_over_channels_only(family):
    policy, eta = policy_for(family)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    traj = rollout(policy, PROMPTS[:2], step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta),
                   generator=gens, decode=False, reduction="per_position")
    grid = tuple(traj.latents.shape[3:])
    assert traj.log_probs.shape == (2, 3, *grid)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    summed = rollout(policy, PROMPTS[:2], step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta),
                     generator=gens, decode=False, reduction="sum")
    torch.testing.assert_close(traj.log_probs.sum(dim=(2, 3)), summed.log_probs, rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        step = recompute_step(policy, traj, 1, reduction="per_position")
    torch.testing.assert_close(step.log_prob, traj.log_probs[:, 1], rtol=0, atol=1e-4)


def test_psm_maps_are_in_unit_interval_on_the_latent_grid():
    psm = PerceptualStructuring(TinyClipBackbone())
    images = world_images(4)
    for grid in [(8, 8), (16, 12), (4, 4)]:
        maps, info = psm(images, grid)
        assert maps.shape == (4, *grid) and maps.min() >= 0 and maps.max() <= 1
        assert not info["fallback"].any()
        assert torch.allclose(maps.amax(dim=(1, 2)), torch.ones(4)) and torch.allclose(maps.amin(dim=(1, 2)),
                                                                                       torch.zeros(4))
    # videos: per-frame maps resampled to the latent frames, one min-max over the volume
    video = torch.stack([images, images.flip(-1), images.flip(-2)], dim=1)  # (4, 3 frames, 3, 32, 32)
    maps, info = psm(video, (2, 8, 8))
    assert maps.shape == (4, 2, 8, 8) and maps.min() >= 0 and maps.max() <= 1 and not info["fallback"].any()


def test_psm_options_change_the_map_and_pca_weights_are_variance_ratios():
    images = world_images(2)
    tokens = TinyClipBackbone().patch_tokens(images)
    assert tokens.shape[:3] == (2, 8, 8)
    proj, ratio = pca_components(tokens.reshape(2, 64, -1), 3)
    assert proj.shape == (2, 64, 3) and (ratio[:, :-1] >= ratio[:, 1:]).all() and (ratio.sum(1) <= 1 + 1e-6).all()
    base, _ = PerceptualStructuring(TinyClipBackbone())(images, (8, 8))
    for kwargs in [{"aggregation": "first"}, {"orientation": "forward"}, {"spatial_sigma": 0.0}]:
        other, _ = PerceptualStructuring(TinyClipBackbone(), **kwargs)(images, (8, 8))
        assert not torch.allclose(base, other)


def test_psm_falls_back_to_all_ones_on_failure_or_constant_images():
    class Broken:
        def patch_tokens(self, images):
            raise RuntimeError("backbone down")

    maps, info = PerceptualStructuring(Broken())(world_images(3), (8, 8))
    assert torch.equal(maps, torch.ones(3, 8, 8)) and info["fallback"].all()
    class Constant:  # every patch token identical: no structure to find
        def patch_tokens(self, images):
            return torch.ones(len(images), 8, 8, 16)

    class NaNs:
        def patch_tokens(self, images):
            out = torch.randn(len(images), 8, 8, 16)
            out[0, 0, 0, 0] = float("nan")  # only sample 0 is broken
            return out

    maps, info = PerceptualStructuring(Constant())(world_images(2), (8, 8))
    assert torch.equal(maps, torch.ones(2, 8, 8)) and info["fallback"].all()
    maps, info = PerceptualStructuring(NaNs())(world_images(2), (8, 8))
    assert torch.equal(maps[0], torch.ones(8, 8)) and info["fallback"].tolist() == [True, False]
    assert maps[1].min() == 0 and maps[1].max() == 1


def test_psm_smoothing_is_scipy_gaussian_filter():
    import numpy as np
    from scipy.ndimage import gaussian_filter, gaussian_filter1d

    # by hand, σ = 1 on (1, 0, 0, 0, 0): scipy's 'reflect' puts x[0] at position −1, so
    # out[0] = (w0 + w1) = (1 + e^−0.5) / Z, Z = Σ_{k=−4..4} e^{−k²/2} = 2.5066208 (radius int(4·1 + 0.5) = 4) -> 0.640915;
    # the earlier smoothing (edge replicated, radius 3): (1 + e^−0.5 + e^−2 + e^−4.5) / 2.5059500 = 0.699525
    impulse = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    assert smooth_1d(impulse, 1.0, 0)[0].item() == pytest.approx(0.640915, abs=1e-6)
    assert smooth_1d(impulse, 1.0, 0, "replicate", 3.0)[0].item() == pytest.approx(0.699525, abs=1e-6)
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 9, 16):  # axes shorter than the radius too (scipy mirrors again and again)
        for sigma in (0.3, 1.0, 2.0):
            x = rng.random(n)
            got = smooth_1d(torch.tensor(x, dtype=torch.float32), sigma, 0).numpy()
            np.testing.assert_allclose(got, gaussian_filter1d(x, sigma), rtol=0, atol=1e-6)
            old = smooth_1d(torch.tensor(x, dtype=torch.float32), sigma, 0, "replicate", 3.0).numpy()
            np.testing.assert_allclose(old, gaussian_filter1d(x, sigma, mode="nearest", truncate=3.0), atol=1e-6)
    # the spatial smoothing: (N, h, w) patch-grid maps, σ = 1, each map through gaussian_filter (both axes)
    for shape in [(3, 8, 8), (2, 3, 5), (1, 16, 12)]:
        maps = rng.random(shape)
        got = smooth_2d(torch.tensor(maps, dtype=torch.float32), 1.0).numpy()
        np.testing.assert_allclose(got, np.stack([gaussian_filter(m, 1.0) for m in maps]), rtol=0, atol=1e-6)
    # the temporal smoothing of a video map (B, F_lat, h, w): σ = 0.3 along the frames (the Wan script filters each
    # pixel's time series with gaussian_filter(series, sigma=0.3))
    volume = rng.random((2, 6, 4, 4))
    got = smooth_1d(torch.tensor(volume, dtype=torch.float32), 0.3, 1).numpy()
    np.testing.assert_allclose(got, gaussian_filter1d(volume, 0.3, axis=1), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[0, :, 1, 2], gaussian_filter(volume[0, :, 1, 2], sigma=0.3), atol=1e-6)

    # the PSM's patch maps use it (steps 2-3 by hand, then scipy, then min-max), and pass the option through
    class Fixed:
        def patch_tokens(self, images):
            return torch.randn(len(images), 6, 6, 16, generator=torch.Generator().manual_seed(0))

    tokens = Fixed().patch_tokens(torch.zeros(2)).reshape(2, 36, 16)
    proj, ratio = pca_components(tokens, 3)
    hi, lo = proj.amax(dim=1, keepdim=True), proj.amin(dim=1, keepdim=True)
    weighted = (((hi - proj) / (hi - lo)) * ratio[:, None, :]).sum(dim=2).clamp(0, 1).reshape(2, 6, 6).double().numpy()
    for kwargs, scipy_kwargs in [({}, {}), ({"smoothing_padding": "replicate", "smoothing_truncate": 3.0},
                                          {"mode": "nearest", "truncate": 3.0})]:
        smoothed = np.stack([gaussian_filter(m, 1.0, **scipy_kwargs) for m in weighted])
        lo_s, hi_s = smoothed.min(axis=(1, 2), keepdims=True), smoothed.max(axis=(1, 2), keepdims=True)
        got = PerceptualStructuring(Fixed(), **kwargs).patch_maps(torch.zeros(2, 3, 32, 32))
        np.testing.assert_allclose(got.numpy(), (smoothed - lo_s) / (hi_s - lo_s), rtol=0, atol=1e-5)
        assert ViPO(backbone=Fixed(), **kwargs).psm.smoothing_padding == kwargs.get("smoothing_padding", "reflect")
    for kwargs, match in [({"smoothing_padding": "mirror"}, "smoothing_padding"),
                          ({"smoothing_truncate": 0}, "smoothing_truncate")]:
        with pytest.raises(ValueError, match=match):
            ViPO(**kwargs)
        with pytest.raises(ValueError, match=match):
            PerceptualStructuring(Fixed(), **kwargs)


def test_dinov2_backbone_loads_from_a_local_folder(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             patch_size=4, image_size=32)).save_pretrained(tmp_path / "dinov2")
    backbone = build_backbone(f"dinov2:{tmp_path / 'dinov2'}")
    assert isinstance(backbone, Dinov2Backbone)
    tokens = backbone.patch_tokens(world_images(2))
    assert tokens.shape == (2, 8, 8, 32)
    maps, _ = PerceptualStructuring(backbone)(world_images(2), (8, 8))
    assert maps.shape == (2, 8, 8) and maps.min() >= 0 and maps.max() <= 1
    with pytest.raises(ValueError, match="not a folder"):
        build_backbone(f"dinov2:{tmp_path / 'missing'}")


def test_advantage_maps_keep_the_sign_of_each_sample_everywhere_and_clip():
    maps = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0))
    adv = torch.tensor([2.0, -1.5, 0.0, 9.0])
    a = advantage_maps(maps, adv, clip=5.0)
    assert (a[0] >= 0).all() and (a[1] <= 0).all() and (a[2] == 0).all()
    assert a.abs().max() <= 5.0 and torch.allclose(a[1], -1.5 * maps[1])
    for i, s in enumerate([1, -1]):
        nz = a[i][maps[i] > 0]
        assert (torch.sign(nz) == s).all()


def grpo_and_ones_vipo(family: str, beta_kl: float = 0.0, sde_type: str | None = None, reference=None) -> list:
    """(loss, gradients, metrics) of `ClippedPolicyGradient` and of ViPO with all-ones maps and the scalar reduction,
    both with `beta_kl`, on the same minibatch (rows 2, 0, 3) of a perturbed policy's rollouts (θ ≠ θ_old, so the
    ratio and the clip are active)."""
    policy, eta = policy_for(family)
    perturb(policy)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=4, guidance_scale=4.5, noise=eta,
                                                 sde_type=sde_type), generator=gens)
    perturb(policy, 0.01)  # θ ≠ θ_old so the ratio and the clip are active
    adv = torch.tensor([1.2, -0.7, 0.3, -2.0])
    grpo = ClippedPolicyGradient(clip_range=1e-2, beta_kl=beta_kl, detach_unconditional=True)
    vipo = ViPO(clip_range=1e-2, reduction="scalar_weighted", map="ones", beta_kl=beta_kl)
    vipo.prepare_epoch(policy, traj, adv)
    rows = torch.tensor([2, 0, 3])
    results = []
    for objective, kwargs in [(grpo, {}), (vipo, {"rows": rows})]:
        for p in policy.trainable_parameters():
            p.grad = None
        loss, metrics = objective(policy, traj.index(rows), adv[rows], 2, reference=reference, **kwargs)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in policy.trainable_parameters()], metrics))
    return results


@pytest.mark.parametrize("family", ["flow", "ddim"])
def test_all_ones_map_with_scalar_reduction_equals_grpo_exactly(family):
    results = grpo_and_ones_vipo(family)
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert results[0][2]["clipfrac"] == results[1][2]["clipfrac"]


@pytest.mark.parametrize("family", ["flow", "ddim"])
def test_per_position_objective_before_any_update_is_minus_the_mean_advantage_map(family):
    policy, eta = policy_for(family)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta),
                   generator=gens, reduction="per_position")
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    vipo = ViPO(clip_range=1e-4)
    vipo.prepare_epoch(policy, traj, adv)
    assert vipo.maps.shape == (4, *traj.latents.shape[3:]) and vipo.maps.min() >= 0 and vipo.maps.max() <= 1
    loss, metrics = vipo(policy, traj, adv, 1, rows=torch.arange(4))
    torch.testing.assert_close(loss, -vipo.advantage_maps.mean(), rtol=1e-4, atol=1e-5)
    assert abs(float(metrics["ratio"]) - 1) < 1e-4
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


def test_scalar_weighted_uses_the_mean_of_the_clipped_advantage_map():
    policy, eta = policy_for("flow")
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    traj = rollout(policy, PROMPTS[:2], step_sampler(policy, num_inference_steps=2, guidance_scale=1.0, noise=eta),
                   generator=gens)
    vipo = ViPO(reduction="scalar_weighted")
    adv = torch.tensor([3.0, -3.0])
    vipo.prepare_epoch(policy, traj, adv)
    loss, _ = vipo(policy, traj, adv, 0, rows=torch.arange(2))
    expected = -(vipo.advantage_maps.flatten(1).mean(1)).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["flow", "ddim"])
def test_the_kl_option_with_all_ones_maps_equals_flow_grpos_kl_exactly(family):
    """``beta_kl`` > 0 adds Flow-GRPO's KL to the frozen base: with the all-ones map and the scalar reduction, ViPO is
    `ClippedPolicyGradient` with the same β_KL, loss and gradients bit for bit; the KL is positive (θ ≠ the base)."""
    from diffalign.reference.frozen_base import FrozenBaseReference

    results = grpo_and_ones_vipo(family, 0.3, "dance" if family == "flow" else None, FrozenBaseReference())
    assert float(results[1][2]["kl"]) > 0
    assert torch.equal(results[0][2]["kl"], results[1][2]["kl"])
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_the_kl_option_adds_beta_times_the_released_kl_to_the_per_position_loss():
    """Per position, loss(β) − loss(0) = β · mean_i mean_elements (μθ − μref)² / (2 s²) with the code form's s (the
    step std over √Δσ on the DanceGRPO SDE), computed here from θ's and the base's step outputs; β = 0 needs no
    reference and reports no KL; a positive β without one is refused."""
    from test_policy_gradient_kl import released_kl

    from diffalign.reference.frozen_base import FrozenBaseReference

    policy, eta = policy_for("flow")
    perturb(policy)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta,
                                                 sde_type="dance"), generator=gens, reduction="per_position")
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    losses = {}
    for beta in (0.0, 0.25):
        vipo = ViPO(beta_kl=beta)
        vipo.prepare_epoch(policy, traj, adv)
        losses[beta], metrics = vipo(policy, traj, adv, 1, rows=torch.arange(4),
                                     reference=FrozenBaseReference() if beta else None)
        assert ("kl" in metrics) == (beta > 0)
    kl = released_kl(policy, traj, "code")  # (its transition K is 1, the one trained here)
    assert kl > 0
    torch.testing.assert_close(losses[0.25] - losses[0.0], 0.25 * kl, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match=r"^method\.beta_kl > 0 needs a reference"):
        ViPO(beta_kl=0.1)(policy, traj, adv, 1)


def test_bad_vipo_options_raise():
    for kwargs, match in [({"reduction": "max"}, "reduction"), ({"map": "sam"}, "map"), ({"clip_range": 0},
                          "clip_range"), ({"timestep_fraction": 0}, "timestep_fraction"),
                          ({"beta_kl": -0.1}, r"method\.beta_kl=-0\.1 must be >= 0"),
                          ({"kl_form": "sum"}, r"method\.kl_form='sum' must be one of")]:
        with pytest.raises(ValueError, match=match):
            ViPO(**kwargs)
    with pytest.raises(ValueError, match="aggregation"):
        PerceptualStructuring(TinyClipBackbone(), aggregation="max")


@pytest.mark.parametrize("case", ["flow", "sd"])
def test_vipo_runs_in_the_online_loop(case, tmp_path):
    from conftest import compose_cfg, online_overrides

    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    model = ["model=tiny_flow_random", "sampler=flow_sde"] if case == "flow" else ["model=tiny_random",
                                                                                  "sampler=ddim"]
    cfg = compose_cfg(model + ["method=vipo", "online.shared_initial_noise=true"] + online_overrides(tmp_path))
    validate_train_config(cfg)
    results = train(cfg)
    assert results["rollouts"] == 16
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert 0 < history[0]["vipo/map_mean"] <= 1 and history[0]["vipo/map_fallback"] < 1


@pytest.mark.parametrize("recipe", ["tiny_vipo_image", "tiny_vipo_wan", "vipo_wan"])
def test_vipo_recipes_compose(recipe, tmp_path):
    from conftest import compose_cfg

    from diffalign.samplers.base import build_sampler

    cfg = compose_cfg([f"recipe={recipe}", f"output_dir={tmp_path}"])
    assert cfg.method._target_ == "diffalign.objectives.vipo.ViPO" and build_sampler(cfg.sampler).noise > 0
    assert cfg.online.shared_initial_noise and cfg.method.clip_range == 1e-4 and cfg.method.timestep_fraction == 0.6
    assert cfg.method.smoothing_padding == "reflect" and cfg.method.smoothing_truncate == 4.0  # scipy's defaults
    if recipe == "tiny_vipo_image":
        from diffalign.config.validation import validate_train_config

        validate_train_config(cfg)


@pytest.mark.parametrize("reduction", ["per_position", "scalar_weighted"])
def test_per_reward_advantages_give_the_weighted_sum_of_single_reward_losses(reduction):
    """ViPO-Wan's two-reward loss: with advantages (B, 2) and coefficients c, the loss and its gradient are
    c_1 𝓛(A_1·M) + c_2 𝓛(A_2·M), each 𝓛 computed by a single-reward ViPO on its own column."""
    policy, eta = policy_for("flow")
    perturb(policy)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    log_red = "per_position" if reduction == "per_position" else "mean"
    traj = rollout(policy, PROMPTS,
                   step_sampler(policy, num_inference_steps=4, guidance_scale=4.5, noise=eta, sde_type="dance"),
                   generator=gens, reduction=log_red)
    perturb(policy, 0.01)
    adv = torch.tensor([[1.2, -0.3], [-0.7, 0.8], [0.3, 0.1], [-2.0, 1.5]])
    coefficients = torch.tensor([1.0, 0.5])
    rows = torch.tensor([2, 0, 3])

    def loss_and_grads(objective, a):
        for p in policy.trainable_parameters():
            p.grad = None
        loss, _ = objective(policy, traj.index(rows), a[rows], 2, rows=rows)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in policy.trainable_parameters()]

    two = ViPO(clip_range=1e-2, reduction=reduction, advantage_per_reward=True)
    two.reward_coefficients = coefficients
    two.prepare_epoch(policy, traj, adv)
    loss, grads = loss_and_grads(two, adv)
    expected_loss, expected_grads = 0.0, None
    for r in range(2):
        one = ViPO(clip_range=1e-2, reduction=reduction)
        one.prepare_epoch(policy, traj, adv[:, r])
        l_r, g_r = loss_and_grads(one, adv[:, r])
        expected_loss = expected_loss + coefficients[r] * l_r
        scaled = [coefficients[r] * g for g in g_r]
        expected_grads = scaled if expected_grads is None else [a + b for a, b in zip(expected_grads, scaled)]
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    two.reward_coefficients = None
    with pytest.raises(ValueError, match="reward_coefficients"):
        two(policy, traj.index(rows), adv[rows], 2, rows=rows)


def test_vipo_wan_options_run_in_the_online_loop(tmp_path):
    """DanceGRPO SDE + two rewards with per-reward advantages + best-of-N 2 of G = 4 on the tiny flow model: runs,
    trains on half of each group, and logs both rewards."""
    from conftest import compose_cfg, online_overrides

    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    cfg = compose_cfg(["model=tiny_flow_random", "sampler=dance_sde", "sampler.num_inference_steps=4",
                       "method=vipo", "method.advantage_per_reward=true", "online.shared_initial_noise=true",
                       "online.best_of_n=2", "reward=[geneval_shapes,jpeg_compressibility]",
                       "reward.jpeg_compressibility.weight=0.5"] + online_overrides(tmp_path))
    validate_train_config(cfg)
    train(cfg)
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert all(h["advantage/kept_fraction"] == 0.5 for h in history)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert "reward/geneval_shapes/mean" in history[0] and "reward/jpeg_compressibility/mean" in history[0]
