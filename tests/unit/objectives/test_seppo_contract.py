"""`SePPO`'s contract, model-free, found by mutation testing (docs/contributing.md#mutation-testing,
``python scripts/mutation.py objectives/seppo``): `seppo_loss` with its defaults and every metric by hand (the AAF
sign s of arXiv:2410.05255 as docs/methods/algorithms.md#seppo restates it, a tie counted as "x^r is a loser"), its
saturation warning, the reference samples (the documented SHA-256 seed per stage and prompt, the stage cache, the
re-encoding, θ_r active while sampling) with a recording rollout, the fields and every message in full."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch

from diffalign.objectives import seppo
from diffalign.objectives.seppo import SePPO, SePPOConfig, anchor_flip, reference_sample_seed, seppo_loss


def test_seppo_loss_with_its_defaults_and_every_metric_by_hand():
    """β = 10, so r = −5 Δ. Row 0: Δw = 0.1 − 0.2, Δr = 0.3 − 0.2: the policy fits the anchor better, s = +1, r^w =
    0.5, r^r = −0.5, z = 1. Row 1: Δw = 0.15, Δr = 0.05: θ_r fits it better, s = −1 (the default "sign" mode), r^w =
    −0.75, r^r = −0.25, z = −0.75 − 0.25 = −1. Row 2: a tie on the anchor (Δw = 0), counted as a loser by the default
    ``aaf_tie="loser"``: s = +1, r^w = r^r = 0, z = 0 (not counted as right, nor r^w > r^r)."""
    model_w, model_r = torch.tensor([0.1, 0.35, 0.2]), torch.tensor([0.3, 0.25, 0.2])
    ref_w, ref_r = torch.full((3,), 0.2), torch.full((3,), 0.2)
    loss, metrics = seppo_loss(model_w, model_r, ref_w, ref_r, beta=10.0)
    z = torch.tensor([1.0, -1.0, 0.0])
    torch.testing.assert_close(loss, torch.log1p(torch.exp(-z)).mean())
    expected = {"loss": float(loss), "implicit_acc": 1 / 3, "flip_rate": 1 / 3, "implicit_acc/winner_vs_sample": 1 / 3,
                "rewards/chosen": (0.5 - 0.75 + 0) / 3, "rewards/reference_sample": (-0.5 - 0.25 + 0) / 3,
                "rewards/margins": 0.0, "anchor_gap": (0.1 - 0.15 + 0) / 3, "model_loss/chosen": 0.65 / 3,
                "model_loss/reference_sample": 0.25, "ref_loss/chosen": 0.2, "ref_loss/reference_sample": 0.2,
                "saturated": 0.0}
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-6), key
        assert metrics[key].shape == () and not metrics[key].requires_grad, key
    winner_tie, _ = seppo_loss(model_w, model_r, ref_w, ref_r, beta=10.0, aaf_tie="winner")  # row 2: s = −1, z = 0
    torch.testing.assert_close(winner_tie, loss)


def test_seppo_loss_refusals_in_full_and_the_smallest_beta():
    ones = torch.ones(2)
    seppo_loss(ones, ones, ones, ones, beta=0.5)  # any β > 0
    with pytest.raises(ValueError, match="^" + re.escape("beta=0.0 must be > 0 (set method.beta, e.g. 2000 as in "
                                                         "SePPO).") + "$"):
        seppo_loss(ones, ones, ones, ones, beta=0.0)
    square = torch.ones(2, 1)  # one shape, but not (B,)
    with pytest.raises(ValueError, match="^" + re.escape("seppo_loss expects four per-sample loss vectors of one shape "
                                                         "(B,); got [(2, 1)]. Reduce each with per_sample_mse first.")
                       + "$"):
        seppo_loss(square, square, square, square, beta=1.0)


def test_saturated_samples_are_counted_and_named_in_the_warning(caplog):
    """Δw = −31 at β = 2: z = 31 > 30."""
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.diffusion_dpo"):
        _, metrics = seppo_loss(torch.zeros(1), torch.zeros(1), torch.tensor([31.0]), torch.zeros(1), beta=2.0)
    assert float(metrics["saturated"]) == 1.0
    assert ("SePPO: 1 of 1 samples had z > 30: already ranked right by a wide margin, ~0 gradient from them "
            "(logsigmoid flat); a few are expected, lower method.beta only if most are") in caplog.text


def test_anchor_flip_is_a_detached_float32_sign_and_names_bad_modes():
    model_w = torch.tensor([0.1, 0.3], dtype=torch.float64, requires_grad=True)
    s = anchor_flip(model_w, torch.full((2,), 0.2, dtype=torch.float64), "sign", "loser")
    assert s.tolist() == [1.0, -1.0] and s.dtype == torch.float32 and not s.requires_grad
    with pytest.raises(ValueError, match="^" + re.escape("method.aaf_mode='always' must be one of ['sign', 'indicator', "
                                                         "'off'].") + "$"):
        anchor_flip(model_w, model_w, "always", "loser")
    with pytest.raises(ValueError, match="^" + re.escape("method.aaf_tie='x' must be 'loser' or 'winner'.") + "$"):
        anchor_flip(model_w, model_w, "off", "x")


def test_every_field_reaches_the_method_and_the_refusals_in_full():
    config = SePPOConfig(beta=0.5, aaf_mode="indicator", aaf_tie="winner", share_noise=False, timestep_min=3,
                         timestep_max=900, sample_reencode=True, sample_cache="off", sample_seed=11)
    method = SePPO(config)
    assert (method.beta, method.aaf_mode, method.aaf_tie, method.share_noise, method.timestep_min, method.timestep_max,
            method.sample_reencode, method.sample_cache, method.sample_seed, method.sampler) == (
        0.5, "indicator", "winner", False, 3, 900, True, "off", 11, None)
    assert method.extra_repr() == ("beta=0.5, aaf_mode='indicator', aaf_tie='winner', share_noise=False, sampler=None, "
                                   "cache='off'")
    for fields, message in (({"beta": 0.0}, "method.beta=0.0 must be > 0; use e.g. method.beta=2000 (SePPO)."),
                            ({"aaf_mode": "flip"}, "method.aaf_mode='flip' must be one of ['sign', 'indicator', 'off']."),
                            ({"aaf_tie": "x"}, "method.aaf_tie='x' must be 'loser' or 'winner'."),
                            ({"sample_cache": "id"}, "method.sample_cache='id' must be one of ['prompt', 'off'].")):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            SePPO(**fields)


def _seed(sample_seed, version, prompt):  # the documented key: SHA-256("sample_seed/version/prompt"), 8 bytes, 63 bits
    return int.from_bytes(hashlib.sha256(f"{sample_seed}/{version}/{prompt}".encode()).digest()[:8], "little") & (
        2**63 - 1)


def _draw(seed):
    return torch.randn((1, 2, 2), generator=torch.Generator().manual_seed(seed))


class _Reference:
    """θ_r: `use(policy)` marks the block; holds the stage's ``version`` and the ``samples`` cache."""

    def __init__(self, version, cached=None):
        self.version, self.samples, self.active, self.used = version, SimpleNamespace(items=dict(cached or {})), False, []

    @contextlib.contextmanager
    def use(self, policy):
        self.used.append(policy)
        self.active = True
        try:
            yield policy
        finally:
            self.active = False


def _recording_rollout(reference, calls):
    def rollout(policy, prompts, sampler, generator, decode):
        calls.append({"prompts": list(prompts), "sampler": sampler, "decode": decode, "active": reference.active,
                      "seeds": [g.initial_seed() for g in generator]})
        finals = torch.stack([torch.randn((1, 2, 2), generator=g) for g in generator])
        return SimpleNamespace(latents=torch.stack([torch.zeros_like(finals), finals], dim=1), images=10 * finals)
    return rollout


def test_reference_samples_one_per_prompt_and_stage_from_the_documented_seed(monkeypatch):
    reference = _Reference(version=3, cached={"b": torch.full((1, 2, 2), 7.0)})
    calls = []
    monkeypatch.setattr(seppo, "rollout", _recording_rollout(reference, calls))
    method = SePPO(sample_seed=5)
    method.sampler = sampler = object()
    policy = SimpleNamespace(device=torch.device("cpu"))
    out, hits = method.reference_samples(policy, ["a", "b", "a"], reference)
    assert hits == 1 and reference.used == [policy]
    assert calls == [{"prompts": ["a"], "sampler": sampler, "decode": False, "active": True,
                      "seeds": [_seed(5, 3, "a")]}]
    assert reference_sample_seed(5, 3, "a") == _seed(5, 3, "a")
    torch.testing.assert_close(out, torch.stack([_draw(_seed(5, 3, "a")), torch.full((1, 2, 2), 7.0),
                                                 _draw(_seed(5, 3, "a"))]), rtol=0, atol=0)
    torch.testing.assert_close(reference.samples.items["a"], _draw(_seed(5, 3, "a")), rtol=0, atol=0)
    again, hits = method.reference_samples(policy, ["a"], reference)
    assert hits == 1 and len(calls) == 1 and torch.equal(again[0], out[0])


def test_reference_samples_without_the_cache_and_re_encoded(monkeypatch):
    reference = _Reference(version=1)
    calls = []
    monkeypatch.setattr(seppo, "rollout", _recording_rollout(reference, calls))
    method = SePPO(sample_cache="off", sample_reencode=True)
    method.sampler = object()
    policy = SimpleNamespace(device=torch.device("cpu"), encode_images=lambda images: images + 1)
    out, hits = method.reference_samples(policy, ["a", "a"], reference, seeds=[11, 12])
    assert hits == 0 and reference.samples.items == {}
    assert [(c["prompts"], c["seeds"], c["decode"]) for c in calls] == [(["a", "a"], [11, 12], True)]
    torch.testing.assert_close(out, 10 * torch.stack([_draw(11), _draw(12)]) + 1, rtol=0, atol=0)


def test_call_time_refusals_in_full():
    method = SePPO()
    with pytest.raises(ValueError, match="^" + re.escape(
            "SePPO samples x^r with its sampler, and none was given: pass sampler= (the run config's method.sampler is "
            "${sampler})") + "$"):
        method.reference_samples(SimpleNamespace(device=torch.device("cpu")), ["a"], _Reference(version=1))
    batch = SimpleNamespace(latents_w=torch.zeros(2, 1, 2, 2), prompts=["a"], prompt_embeds=[0, 0])
    with pytest.raises(ValueError, match="^" + re.escape(
            "batch has 2 winners but 1 prompts and 2 prompt embeddings; pass one of each per winner.") + "$"):
        method(None, batch, reference=_Reference(version=1))
    with pytest.raises(ValueError, match="^" + re.escape(
            "SePPO needs a reference strategy holding θ_r (diffalign.reference); the training loop passes the one "
            "configured by `reference=` (SePPO: reference=pool).") + "$"):
        method(None, batch)


def test_reference_sample_seeds_keep_63_bits_of_the_digest():
    """The seed is the digest's first 8 bytes, little-endian, masked to 63 bits: odd and even ones alike."""
    seeds = [reference_sample_seed(7, 2, p) for p in ("a", "b", "c", "d", "e", "f")]
    assert seeds == [_seed(7, 2, p) for p in ("a", "b", "c", "d", "e", "f")]
    assert {s % 2 for s in seeds} == {0, 1} and all(0 <= s < 2**63 for s in seeds)


class _RecordingPolicy:
    """What `SePPO.forward` reads of a policy: x_t = x_0 + ε, target ε, prediction 0; records `add_noise`'s inputs."""

    device = torch.device("cpu")
    scheduler = SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000))

    def add_noise(self, latents, noise, timesteps):
        self.got = (latents, noise, timesteps)
        return latents + noise

    def training_target(self, latents, noise, timesteps):
        return noise

    def predict(self, x, timesteps, prompt_embeds, guidance_scale=1.0):
        return torch.zeros_like(x)


@pytest.mark.parametrize("share_noise", [True, False])
def test_forward_draws_t_then_eps_and_a_second_eps_for_the_reference_samples_unless_shared(share_noise):
    """Step 1 of the class docstring: t ~ U{timestep_min..timestep_max} (here 500..500), then ε, from the generator in
    that order; with ``share_noise=False`` a second ε for x^r. The x^r of both prompts come from the stage cache."""
    from diffalign.types import PromptEmbeds

    cached = {"a": torch.full((1, 2, 2), 3.0), "b": torch.full((1, 2, 2), -3.0)}
    reference = _Reference(version=1, cached=cached)
    batch = SimpleNamespace(latents_w=torch.ones(2, 1, 2, 2), prompts=["a", "b"],
                            prompt_embeds=PromptEmbeds(torch.zeros(2, 3, 2)))
    policy = _RecordingPolicy()
    method = SePPO(share_noise=share_noise, timestep_min=500, timestep_max=500)
    _, metrics = method(policy, batch, generator=torch.Generator().manual_seed(4), reference=reference)
    gen = torch.Generator().manual_seed(4)
    t = torch.randint(500, 501, (2,), generator=gen)
    eps = torch.randn((2, 1, 2, 2), generator=gen)
    eps_r = eps if share_noise else torch.randn((2, 1, 2, 2), generator=gen)
    latents, noise, timesteps = policy.got
    assert timesteps.tolist() == [500] * 4 and t.tolist() == [500, 500]
    torch.testing.assert_close(noise, torch.cat([eps, eps_r]), rtol=0, atol=0)
    torch.testing.assert_close(latents, torch.cat([batch.latents_w, torch.stack([cached["a"], cached["b"]])]),
                               rtol=0, atol=0)
    assert float(metrics["reference/cache_hits"]) == 1.0


def test_without_the_cache_each_winner_gets_a_seed_drawn_after_t_and_eps(monkeypatch):
    """``sample_cache="off"``: the x^r seeds are ``randint(0, 2**62)``, one per winner, drawn from the generator after
    t and ε (class docstring, step 2), and the rollout's final latents are the x^r."""
    from diffalign.types import PromptEmbeds

    reference, calls = _Reference(version=1), []
    monkeypatch.setattr(seppo, "rollout", _recording_rollout(reference, calls))
    batch = SimpleNamespace(latents_w=torch.ones(2, 1, 2, 2), prompts=["a", "a"],
                            prompt_embeds=PromptEmbeds(torch.zeros(2, 3, 2)))
    policy = _RecordingPolicy()
    method = SePPO(sample_cache="off", timestep_min=500, timestep_max=500)
    method.sampler = object()
    method(policy, batch, generator=torch.Generator().manual_seed(4), reference=reference)
    gen = torch.Generator().manual_seed(4)
    torch.randint(500, 501, (2,), generator=gen)
    torch.randn((2, 1, 2, 2), generator=gen)
    seeds = torch.randint(0, 2**62, (2,), generator=gen).tolist()
    assert [c["seeds"] for c in calls] == [seeds] and reference.samples.items == {}
    torch.testing.assert_close(policy.got[0][2:], torch.stack([_draw(s) for s in seeds]), rtol=0, atol=0)


def test_reference_samples_take_the_winners_dtype():
    """bf16 winners: the float32 x^r of the cache are cast to bf16 before they join the batch (a float32 x^r would
    promote the whole batch to float32)."""
    from diffalign.types import PromptEmbeds

    cached = {"a": torch.full((1, 2, 2), 0.5)}
    batch = SimpleNamespace(latents_w=torch.ones(1, 1, 2, 2, dtype=torch.bfloat16), prompts=["a"],
                            prompt_embeds=PromptEmbeds(torch.zeros(1, 3, 2)))
    policy = _RecordingPolicy()
    SePPO()(policy, batch, generator=torch.Generator().manual_seed(0), reference=_Reference(version=1, cached=cached))
    latents, noise, _ = policy.got
    assert latents.dtype == noise.dtype == torch.bfloat16 and latents[1].tolist() == [[[0.5, 0.5], [0.5, 0.5]]]


def test_the_sampler_node_is_built_and_the_timestep_range_refused_in_full():
    """``sampler`` as a config node becomes its `Sampler` (`build_sampler` under the name ``sampler``), and a bad node,
    a negative or an empty timestep range are refused at construction, naming the field."""
    from diffalign.config.checks import ConfigError

    method = SePPO(sampler={"name": "ddim", "num_inference_steps": 3, "guidance_scale": 2.0, "eta": 0.0})
    assert (type(method.sampler).__name__, method.sampler.num_inference_steps, method.sampler.guidance_scale,
            method.sampler.eta) == ("DDIMSampler", 3, 2.0, 0.0)
    with pytest.raises(ConfigError, match="^" + re.escape("sampler.eta must be a number >= 0, got -1") + ";"):
        SePPO(sampler={"name": "ddim", "eta": -1})
    for fields, message in (({"timestep_min": -1}, "method.timestep_min=-1 must be >= 0."),
                            ({"timestep_min": 10, "timestep_max": 5},
                             ("method.timestep_max=5 is below method.timestep_min=10; set timestep_max >= "
                              "timestep_min, or null for the scheduler's last timestep."))):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            SePPO(**fields)


class _ScalingPolicy(_RecordingPolicy):
    """f(x_t, t, c) = a x_t + mean(c) with a = the trainable ``scale`` (0.5) and a = `ref_scale` while θ_r is active;
    target ε − (t / 1000) x_0; records every call (θ_r active, grad enabled, guidance, timesteps, the rows' condition)."""

    def __init__(self, reference, ref_scale=0.8):
        self.reference, self.calls, self.ref_scale = reference, [], ref_scale
        self.scale = torch.tensor(0.5, requires_grad=True)

    def training_target(self, latents, noise, timesteps):
        return noise - timesteps.view(-1, 1, 1, 1) / 1000 * latents

    def predict(self, x, timesteps, prompt_embeds, guidance_scale=None):
        c = prompt_embeds.prompt_embeds.mean(dim=(1, 2))
        self.calls.append({"reference": self.reference.active, "grad": torch.is_grad_enabled(),
                           "guidance_scale": guidance_scale, "timesteps": timesteps.tolist(), "c": c.tolist()})
        a = torch.tensor(self.ref_scale) if self.reference.active else self.scale
        return a * x + c.view(-1, 1, 1, 1)


def test_forward_loss_by_hand_with_the_anchor_sign_and_the_cache_hit_rate(monkeypatch):
    """SePPO's loss (docs/methods/algorithms.md#seppo) from scratch: per-sample MSE of the policy and of θ_r against ε
    on [x^w_t; x^r_t] (x_t = x_0 + ε, one t and ε per winner shared with its x^r), Δ = ℓ_θ − ℓ_θr, s = sign(ℓ_θr(x^w) −
    ℓ_θ(x^w)), z = −β/2 (Δ_w − s Δ_r), L = mean log(1 + e^−z); x^r of "a" from the stage cache (2 of 3 rows) and of "b"
    sampled from its documented seed; θ_r runs without gradient, both unguided, on the winners' own conditions."""
    from diffalign.types import PromptEmbeds

    cached = {"a": torch.tensor([[[0.3, -1.2], [2.0, 0.1]]])}
    reference, calls = _Reference(version=2, cached=cached), []
    monkeypatch.setattr(seppo, "rollout", _recording_rollout(reference, calls))
    latents_w = torch.tensor([[[[1.0, -0.5], [0.2, 0.7]]], [[[-2.0, 0.4], [1.5, -0.3]]], [[[0.0, 0.1], [-0.1, 0.0]]]])
    embeds = torch.stack([torch.full((3, 2), v) for v in (0.1, -0.4, 0.05)])
    batch = SimpleNamespace(latents_w=latents_w, prompts=["a", "b", "a"], prompt_embeds=PromptEmbeds(embeds))
    policy = _ScalingPolicy(reference)
    method = SePPO(beta=3.0, timestep_min=100, timestep_max=900)
    method.sampler = object()
    loss, metrics = method(policy, batch, generator=torch.Generator().manual_seed(6), reference=reference)

    gen = torch.Generator().manual_seed(6)
    t = torch.randint(100, 901, (3,), generator=gen)
    eps = torch.randn((3, 1, 2, 2), generator=gen)
    x_r = torch.stack([cached["a"], _draw(_seed(0, 2, "b")), cached["a"]])
    assert [c["seeds"] for c in calls] == [[_seed(0, 2, "b")]]
    x_0, t2 = torch.cat([latents_w, x_r]), torch.cat([t, t]).view(-1, 1, 1, 1)
    x_t, target = x_0 + torch.cat([eps, eps]), torch.cat([eps, eps]) - t2 / 1000 * x_0
    c = torch.tensor([0.1, -0.4, 0.05, 0.1, -0.4, 0.05]).view(-1, 1, 1, 1)
    ell = ((0.5 * x_t + c - target) ** 2).mean(dim=(1, 2, 3)).tolist()
    ell_r = ((0.8 * x_t + c - target) ** 2).mean(dim=(1, 2, 3)).tolist()
    want, signs = 0.0, []
    for i in range(3):
        s = 1.0 if ell_r[i] - ell[i] >= 0 else -1.0
        z = -1.5 * ((ell[i] - ell_r[i]) - s * (ell[3 + i] - ell_r[3 + i]))
        want += math.log1p(math.exp(-z)) / 3
        signs.append(s)
    assert sorted(set(signs)) == [-1.0, 1.0]  # the data exercise both branches of the anchor
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    assert float(metrics["flip_rate"]) == pytest.approx(signs.count(-1.0) / 3)
    assert float(metrics["model_loss/chosen"]) == pytest.approx(sum(ell[:3]) / 3, rel=1e-5)
    assert float(metrics["ref_loss/reference_sample"]) == pytest.approx(sum(ell_r[3:]) / 3, rel=1e-5)
    assert float(metrics["reference/cache_hits"]) == pytest.approx(2 / 3)
    assert [(k["reference"], k["grad"], k["guidance_scale"], k["timesteps"]) for k in policy.calls] == [
        (False, True, 1.0, t.tolist() * 2), (True, False, 1.0, t.tolist() * 2)]
    assert all(k["c"] == pytest.approx([0.1, -0.4, 0.05] * 2) for k in policy.calls)
    assert len(reference.used) == 2 and all(u is policy for u in reference.used)  # sampling x^r, then θ_r's forward
    loss.backward()
    assert policy.scale.grad is not None and float(policy.scale.grad) != 0.0


def test_forward_passes_aaf_tie_a_tie_at_theta_equal_theta_r_counts_as_a_winner():
    """θ = θ_r (the first step of a stage): every anchor gap is 0; ``aaf_tie="winner"`` flips every x^r (flip_rate 1),
    the default "loser" none; z = 0 either way, so the loss is ln 2."""
    from diffalign.types import PromptEmbeds

    for tie, flips in (("winner", 1.0), ("loser", 0.0)):
        reference = _Reference(version=1, cached={"a": torch.ones(1, 2, 2)})
        batch = SimpleNamespace(latents_w=torch.ones(2, 1, 2, 2), prompts=["a", "a"],
                                prompt_embeds=PromptEmbeds(torch.zeros(2, 3, 2)))
        loss, metrics = SePPO(aaf_tie=tie)(_ScalingPolicy(reference, ref_scale=0.5), batch,
                                           generator=torch.Generator().manual_seed(1), reference=reference)
        assert float(metrics["flip_rate"]) == flips and float(loss.detach()) == pytest.approx(math.log(2))
