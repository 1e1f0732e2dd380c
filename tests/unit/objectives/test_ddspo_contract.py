"""`DDSPO`'s model-free contract (docs/contributing.md#mutation-testing, ``python scripts/mutation.py
objectives/ddspo``): `ddspo_loss` against `diffusion_dpo_loss` (the Diffusion-DPO loss of arXiv:2311.12908 Eq. 14 that
DDSPO keeps, docs/methods/algorithms.md#ddspo) with and without the per-pair weights ω_t, `rand_cond_probability`'s
defaults (the authors' sigmoid, λ = 20), the x_0 prediction space x̂_0 = x_σ − σ v̂, the replaced rows of a batch's
conditions, the fields and every message in full."""

from __future__ import annotations

import contextlib
import math
import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from diffalign.objectives.ddspo import DDSPO, DDSPOConfig, _with_rows, ddspo_loss, rand_cond_probability
from diffalign.objectives.diffusion_dpo import diffusion_dpo_loss
from diffalign.types import PromptEmbeds

LOSSES = (torch.tensor([0.1, 0.4]), torch.tensor([0.3, 0.2]), torch.tensor([0.2, 0.2]), torch.tensor([0.2, 0.1]))


def test_without_weights_ddspo_loss_is_diffusion_dpos_and_with_them_each_pair_is_weighted():
    """β = 10: z = −5 [(m_w − r_w) − (m_l − r_l)] = −5 (−0.1 − 0.1) = 1 and −5 (0.2 − 0.1) = −0.5; ω = (0.25, 2) in
    float64 gives mean(ω · log(1 + e^−z))."""
    loss, metrics = ddspo_loss(*LOSSES, beta=10.0)
    dpo, dpo_metrics = diffusion_dpo_loss(*LOSSES, beta=10.0)
    torch.testing.assert_close(loss, dpo, rtol=0, atol=0)
    assert set(metrics) == set(dpo_metrics) and all(torch.equal(metrics[k], dpo_metrics[k]) for k in metrics)
    weighted, metrics = ddspo_loss(*LOSSES, beta=10.0, weights=torch.tensor([0.25, 2.0], dtype=torch.float64))
    want = (0.25 * math.log1p(math.exp(-1.0)) + 2.0 * math.log1p(math.exp(0.5))) / 2
    assert weighted.dtype == torch.float32 and float(weighted) == pytest.approx(want, abs=1e-6)
    assert float(metrics["loss"]) == float(weighted) and not metrics["loss"].requires_grad
    assert float(metrics["implicit_acc"]) == float(dpo_metrics["implicit_acc"]) == 0.5  # the rest is Diffusion-DPO's
    with pytest.raises(ValueError, match="^" + re.escape("weights has shape (3,); pass one weight per pair, shape (2,).")
                       + "$"):
        ddspo_loss(*LOSSES, beta=1.0, weights=torch.ones(3))


def test_rand_cond_probability_defaults_to_the_authors_sigmoid_and_names_a_bad_schedule():
    """s = t / T: σ(20 (s − 0.7)) by default; at t = 350 of T = 500, s = 0.7 and p = ½; "constant" is float32 ones."""
    t = torch.tensor([350, 500, 0])
    torch.testing.assert_close(rand_cond_probability(t, 500),
                               torch.tensor([0.5, 1 / (1 + math.exp(-6)), 1 / (1 + math.exp(14))]))
    assert rand_cond_probability(t, 500, "constant").dtype == torch.float32
    torch.testing.assert_close(rand_cond_probability(t, 500, "exponential", 2.0),
                               torch.tensor([math.exp(-0.6), 1.0, math.exp(-2.0)]))
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.rand_cond_schedule='step' must be one of ['sigmoid', 'exponential', 'constant'].") + "$"):
        rand_cond_probability(t, 500, "step")


def test_with_rows_replaces_the_masked_rows_in_order():
    embeds = PromptEmbeds(torch.zeros(3, 2, 1), pooled_prompt_embeds=torch.zeros(3, 4))
    new = PromptEmbeds(torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]]]), pooled_prompt_embeds=torch.ones(2, 4))
    out = _with_rows(embeds, torch.tensor([True, False, True]), new)
    assert out.prompt_embeds[:, :, 0].tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 4.0]]
    assert out.pooled_prompt_embeds.sum(dim=1).tolist() == [4.0, 0.0, 4.0] and embeds.prompt_embeds.sum() == 0
    plain = _with_rows(PromptEmbeds(torch.zeros(3, 2, 1)), torch.tensor([False, True, False]), new.index(torch.tensor([1])))
    assert plain.pooled_prompt_embeds is None and plain.prompt_embeds[1, :, 0].tolist() == [3.0, 4.0]


def test_x0_space_is_the_noisy_latent_minus_sigma_times_the_velocity():
    """x̂_0 = x_σ − σ v̂ with σ = t / T (docs/methods/algorithms.md#forward-processes): t = (250, 750) of T = 1000."""

    class Policy:
        scheduler = type("S", (), {"config": OmegaConf.create({"num_train_timesteps": 1000})})()

    method = DDSPO(cpp="off", prediction_space="x0")
    noisy, v = torch.ones(2, 1, 2), torch.tensor([[[2.0, 4.0]], [[-1.0, 0.0]]])
    out = method._to_space(Policy(), v, noisy, torch.tensor([250, 750]))
    assert out.tolist() == [[[0.5, 0.0]], [[1.75, 1.0]]]
    assert DDSPO(cpp="off")._to_space(Policy(), v, noisy, torch.tensor([250, 750])) is v  # native: as predicted


def test_every_field_reaches_the_method_and_the_refusals_in_full():
    config = DDSPOConfig(beta=0.5, cpp="dd", loss_weighting="linear", prediction_space="x0", rand_cond=True,
                         rand_cond_schedule="exponential", rand_cond_lambda=3.0, target_lora_w="w", target_lora_l="l",
                         timestep_min=2, timestep_max=800)
    method = DDSPO(config)
    assert (method.beta, method.cpp, method.loss_weighting, method.prediction_space, method.rand_cond,
            method.rand_cond_schedule, method.rand_cond_lambda, method.target_lora_w, method.target_lora_l,
            method.timestep_min, method.timestep_max, method.pool, method.targets) == (
        0.5, "dd", "linear", "x0", True, "exponential", 3.0, "w", "l", 2, 800, None, None)
    assert method.extra_repr() == "beta=0.5, cpp='dd', loss_weighting='linear', prediction_space='x0', rand_cond=True"
    for fields, message in (
            ({"beta": 0.0}, "method.beta=0.0 must be > 0; use e.g. method.beta=16000 (DDSPO SD1.x TF-CPP)."),
            ({"cpp": "both"}, "method.cpp='both' must be one of ['tf', 'dd', 'off']."),
            ({"loss_weighting": "sigmoid"}, "method.loss_weighting='sigmoid' must be one of ['uniform', 'linear']."),
            ({"prediction_space": "eps"}, "method.prediction_space='eps' must be one of ['native', 'x0']."),
            ({"rand_cond_schedule": "step"},
             "method.rand_cond_schedule='step' must be one of ['sigmoid', 'exponential', 'constant']."),
            ({"cpp": "dd", "target_lora_w": "w"}, ("method.cpp=dd needs method.target_lora_w and method.target_lora_l "
                                                   "(the winner/ and loser/ folders of diffalign-ddcpp-targets)."))):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            DDSPO(**fields)


def test_check_config_asks_for_the_degraded_prompts_in_full():
    data = "diffalign.data.shapes_pairs.ShapesPairs"
    cfg = OmegaConf.create({"method": {"cpp": "tf"}, "data": {"_target_": data}})
    with pytest.raises(ValueError, match="^" + re.escape(
            "method=ddspo with method.cpp=tf needs the degraded prompts c⁻ of DDSPO pairs, but data=ShapesPairs has "
            "none; pass data=ddspo_pairs data.pairs_dir=<folder> (made by diffalign-ddspo-pairs, or add "
            "data.generate=true), or method.cpp=dd with its target LoRAs") + "$"):
        DDSPO.check_config(cfg)
    DDSPO.check_config(OmegaConf.create({"method": {"cpp": "off"}, "data": {"_target_": data}}))
    DDSPO.check_config(OmegaConf.create({"method": {"cpp": "tf"},
                                         "data": {"_target_": "diffalign.data.ddspo_pairs.DDSPOPairs"}}))


def test_check_config_defaults_to_tf_cpp_and_in_batch_rand_cond_needs_the_degraded_prompts():
    """``method.cpp`` left out is "tf" (DDSPOConfig's default), named as such; ``rand_cond`` without a prompt file reads
    the batch's c⁻ even under ``cpp=off``; with ``rand_cond_prompts`` it does not."""
    from diffalign.config.checks import ConfigError

    shapes = {"_target_": "diffalign.data.shapes_pairs.ShapesPairs"}
    fix = (" needs the degraded prompts c⁻ of DDSPO pairs, but data=ShapesPairs has none; pass data=ddspo_pairs "
           "data.pairs_dir=<folder> (made by diffalign-ddspo-pairs, or add data.generate=true), or method.cpp=dd with "
           "its target LoRAs")
    with pytest.raises(ConfigError, match="^" + re.escape("method=ddspo with method.cpp=tf" + fix) + "$"):
        DDSPO.check_config(OmegaConf.create({"method": {}, "data": shapes}))
    with pytest.raises(ConfigError, match="^" + re.escape("method=ddspo with method.cpp=off" + fix) + "$"):
        DDSPO.check_config(OmegaConf.create({"method": {"cpp": "off", "rand_cond": True}, "data": shapes}))
    DDSPO.check_config(OmegaConf.create({"method": {"cpp": "off", "rand_cond": True, "rand_cond_prompts": "p.txt"},
                                         "data": shapes}))


def test_setup_adds_target_adapters_only_for_dd_cpp():
    method = DDSPO(cpp="tf")
    method.setup(object())  # a policy without a UNet: nothing is loaded
    assert method.targets is None


def test_the_prompt_pool_keeps_given_variants_degrades_the_others_and_skips_one_word_prompts(tmp_path):
    """``rand_cond_prompts`` rows: a ``degraded_prompts`` list is kept; otherwise `random_word_removal` with seed 0
    (class docstring); a prompt that cannot be degraded is skipped, and the rows after it still count."""
    from diffalign.data.degrade import random_word_removal

    path = tmp_path / "pool.jsonl"
    path.write_text('{"prompt": "x y", "degraded_prompts": ["x"]}\n{"prompt": "cube"}\n'
                    '{"prompt": "a red cube on green grass"}\n')
    method = DDSPO(cpp="off", rand_cond=True, rand_cond_prompts=str(path))
    assert method.pool == [("x y", ["x"]), ("a red cube on green grass",
                                            random_word_removal("a red cube on green grass", seed=0))]
    assert method.pool[1][1] == ['on grass', 'a red grass', 'cube grass', 'red cube grass', 'a grass']
    one_word = tmp_path / "one.txt"
    one_word.write_text("cube\n")
    with pytest.raises(ValueError, match="^" + re.escape(
            f"method.rand_cond_prompts={str(one_word)!r} has no prompt that can be degraded.") + "$"):
        DDSPO(cpp="off", rand_cond=True, rand_cond_prompts=str(one_word))
    with pytest.raises(FileNotFoundError, match="^" + re.escape("method.rand_cond_prompts=")):
        DDSPO(cpp="off", rand_cond=True, rand_cond_prompts=str(tmp_path / "missing.txt"))


def test_with_rows_casts_the_new_rows_to_the_old_dtype():
    out = _with_rows(PromptEmbeds(torch.zeros(2, 1, 1)), torch.tensor([False, True]),
                     PromptEmbeds(torch.full((1, 1, 1), 0.25, dtype=torch.float64)))
    assert out.prompt_embeds.dtype == torch.float32 and out.prompt_embeds.flatten().tolist() == [0.0, 0.25]


def test_without_cpp_the_target_is_the_policys_training_target_at_the_pairs_timesteps():
    """``cpp="off"``: the target is `training_target(x_0, ε, t)` with the rows' own t (winner then loser: one t per pair,
    repeated), as Diffusion-DPO (a v-prediction target reads t)."""

    class Policy:
        prediction_type = "v_prediction"
        scheduler = SimpleNamespace(config=SimpleNamespace(num_train_timesteps=1000))

        def add_noise(self, latents, noise, timesteps):
            return latents + noise

        def training_target(self, latents, noise, timesteps):
            self.target_timesteps = timesteps
            return noise

        def predict(self, x, timesteps, prompt_embeds, guidance_scale=1.0):
            return torch.zeros_like(x)

        def reference(self):
            return contextlib.nullcontext()

    batch = SimpleNamespace(latents_w=torch.ones(2, 1, 2, 2), latents_l=torch.zeros(2, 1, 2, 2), prompts=["a", "b"],
                            prompt_embeds=PromptEmbeds(torch.zeros(2, 3, 2)), degraded_prompt_embeds=None)
    policy = Policy()
    DDSPO(cpp="off", timestep_min=100, timestep_max=900)(policy, batch, generator=torch.Generator().manual_seed(3))
    t = torch.randint(100, 901, (2,), generator=torch.Generator().manual_seed(3))
    assert policy.target_timesteps.tolist() == t.tolist() * 2


class _EncodingPolicy:
    """Records `encode_prompts`' calls and returns the prompts themselves."""

    def __init__(self):
        self.calls = []

    def encode_prompts(self, prompts, do_classifier_free_guidance=True):
        self.calls.append((list(prompts), do_classifier_free_guidance))
        return list(prompts)


def _draw(low, high, generator):
    return int(torch.randint(low, high, (1,), generator=generator))


def test_unpaired_conditions_from_the_pool_with_one_or_per_pair_generators(tmp_path):
    """Class docstring, step 2, with ``rand_cond_prompts``: one generator draws every masked pair's pick, then every
    variant index (mod its variants); a list draws each masked pair's pick then its variant from that pair's own."""
    path = tmp_path / "pool.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "degraded_prompts": ["p{i}-a", "p{i}-b", "p{i}-c"]}}\n'
                            for i in range(5)))
    method = DDSPO(cpp="off", rand_cond=True, rand_cond_prompts=str(path))
    batch = SimpleNamespace(prompts=["x", "y", "z"])
    mask = torch.tensor([True, False, True])
    policy = _EncodingPolicy()
    prompts, degraded = method._unpaired_conditions(policy, batch, torch.ones(3, dtype=torch.bool),
                                                    torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(8)
    picks = torch.randint(0, 5, (3,), generator=gen).tolist()
    variants = torch.randint(0, 2**31, (3,), generator=gen).tolist()
    assert prompts == [f"p{i}" for i in picks]
    assert degraded == [f"p{i}-{'abc'[v % 3]}" for i, v in zip(picks, variants)]
    assert policy.calls == [(prompts, False), (degraded, False)]
    gens = [torch.Generator().manual_seed(s) for s in (20, 21, 22)]
    prompts, degraded = method._unpaired_conditions(policy, batch, mask, gens)
    want = []
    for s in (20, 22):  # the masked pairs' own generators
        g = torch.Generator().manual_seed(s)
        pick = _draw(0, 5, g)
        want.append((f"p{pick}", f"p{pick}-{'abc'[_draw(0, 2**31, g) % 3]}"))
    assert list(zip(prompts, degraded)) == want
    gens = [torch.Generator().manual_seed(s) for s in (40, 41, 42)]
    _, degraded = method._unpaired_conditions(policy, batch, torch.ones(3, dtype=torch.bool), gens)
    want = []
    for s in (40, 41, 42):
        g = torch.Generator().manual_seed(s)
        pick = _draw(0, 5, g)
        want.append(f"p{pick}-{'abc'[_draw(0, 2**31, g) % 3]}")
    assert degraded == want


def test_unpaired_conditions_from_the_batch_shift_each_masked_pair():
    """Without a pool: pair i takes the conditions of pair (i + s) mod B, s ~ U{1..B−1} drawn once with one generator,
    or per masked pair from its own; B = 1 is refused in full."""
    method = DDSPO(cpp="off", rand_cond=True)
    embeds = PromptEmbeds(torch.arange(4.0).view(4, 1, 1))
    batch = SimpleNamespace(prompts=list("abcd"), prompt_embeds=embeds, degraded_prompt_embeds=PromptEmbeds(
        10 + torch.arange(4.0).view(4, 1, 1)))
    mask = torch.tensor([False, True, False, True])
    c, c_minus = method._unpaired_conditions(None, batch, mask, torch.Generator().manual_seed(5))
    s = _draw(1, 4, torch.Generator().manual_seed(5))
    assert c.prompt_embeds.flatten().tolist() == [float((1 + s) % 4), float((3 + s) % 4)]
    assert c_minus.prompt_embeds.flatten().tolist() == [10.0 + (1 + s) % 4, 10.0 + (3 + s) % 4]
    gens = [torch.Generator().manual_seed(s) for s in (30, 31, 32, 33)]
    c, _ = method._unpaired_conditions(None, batch, mask, gens)
    shifts = [_draw(1, 4, torch.Generator().manual_seed(s)) for s in (31, 33)]
    assert c.prompt_embeds.flatten().tolist() == [float((1 + shifts[0]) % 4), float((3 + shifts[1]) % 4)]
    two = SimpleNamespace(prompts=["a", "b"], prompt_embeds=PromptEmbeds(torch.arange(2.0).view(2, 1, 1)),
                          degraded_prompt_embeds=PromptEmbeds(torch.zeros(2, 1, 1)))
    c, _ = method._unpaired_conditions(None, two, torch.tensor([True, False]), torch.Generator())
    assert c.prompt_embeds.flatten().tolist() == [1.0]  # B = 2: the only shift, 1
    one = SimpleNamespace(prompts=["a"], prompt_embeds=PromptEmbeds(torch.zeros(1, 1, 1)), degraded_prompt_embeds=None)
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.rand_cond draws the unpaired prompts from the batch, which needs trainer.batch_size >= 2; or set "
            "method.rand_cond_prompts to a prompt file.") + "$"):
        method._unpaired_conditions(None, one, torch.tensor([True]), torch.Generator())


def test_call_time_refusals_in_full():
    """Each refusal of `forward`, before any draw, names the field and the fix."""
    pairs = SimpleNamespace(latents_w=torch.zeros(2, 1, 2, 2), latents_l=torch.zeros(2, 1, 2, 3), prompts=["a", "b"],
                            prompt_embeds=PromptEmbeds(torch.zeros(2, 3, 2)), degraded_prompt_embeds=None)
    policy = SimpleNamespace(prediction_type="epsilon")

    def like(**fields):
        return SimpleNamespace(**{**vars(pairs), "latents_l": torch.zeros(2, 1, 2, 2), **fields})

    for method, batch, message in (
            (DDSPO(cpp="off"), pairs, ("batch.latents_w has shape (2, 1, 2, 2) but batch.latents_l has shape "
                                       "(2, 1, 2, 3); winner and loser must have one shape.")),
            (DDSPO(cpp="off"), like(prompt_embeds=PromptEmbeds(torch.zeros(3, 3, 2))),
             "batch.prompt_embeds has 3 rows for 2 pairs."),
            (DDSPO(cpp="tf"), like(),
             ("method.cpp='tf' (or rand_cond from the batch) needs the degraded prompts c⁻ of the pairs "
              "(PreferenceBatch.degraded_prompt_embeds, B rows): train on DDSPO pairs (data=ddspo_pairs), or use "
              "method.cpp=off / dd.")),
            (DDSPO(cpp="dd", target_lora_w="w", target_lora_l="l"),
             like(),
             "method.cpp=dd: call objective.setup(policy) first (the training loop does) to load the target LoRAs.")):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            method(policy, batch)
