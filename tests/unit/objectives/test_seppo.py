"""SePPO (arXiv:2410.05255; docs/methods/algorithms.md#seppo): hand-computed losses, equivalence with Diffusion-DPO
when the flipper is forced to +1, ln 2 at the first step, the reference-sample cache, winner fine-tuning, and CLI runs
with exact resume."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import run_cli_in_process, step_sampler
from safetensors.torch import load_file

from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.diffusion_dpo import DiffusionDPO
from diffalign.objectives.seppo import SePPO, SePPOConfig, anchor_flip, seppo_loss
from diffalign.objectives.sft import WinnerSFT, WinnerSFTConfig
from diffalign.reference.pool import PoolReference
from diffalign.samplers.rollout import rollout
from diffalign.types import PreferenceBatch, WinnerBatch

LN2 = math.log(2.0)
PROMPTS = ["a red circle", "two blue squares"]
SAMPLE = {"sampler": {"name": "ddim", "num_inference_steps": 3, "guidance_scale": 2.0, "eta": 0.0}}


def winner_batch(policy, prompts=PROMPTS, seed: int = 0) -> WinnerBatch:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((len(prompts), *policy.latent_shape), generator=gen)
    return WinnerBatch(latents, list(prompts), policy.encode_prompts(list(prompts), do_classifier_free_guidance=False),
                       torch.arange(len(prompts)))


def pool_policy(perturb_lora, stage_seed: int = 1, policy_seed: int | None = 2):
    """A tiny policy whose pool holds θ_0 = LoRA perturbed with `stage_seed`; the policy is then moved away from θ_0
    (perturbed with `policy_seed`) unless that is None."""
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy, seed=stage_seed)
    pool = PoolReference(save_every=100, keep=3)
    pool.setup(policy)
    pool.on_step(policy, 0)
    if policy_seed is not None:
        perturb_lora(policy, seed=policy_seed)
    return policy, pool


# ------------------------------------------------------------------------------------------------ loss arithmetic


def test_hand_computed_loss_per_aaf_mode():
    # sample 0: Δw = 0.1 - 0.2 = -0.1 (policy fits the anchor better, s = +1), Δr = 0.3 - 0.2 = 0.1
    # sample 1: Δw = 0.3 - 0.2 = +0.1 (reference fits it better, flip),       Δr = 0.25 - 0.2 = 0.05; β = 10
    args = (torch.tensor([0.1, 0.3]), torch.tensor([0.3, 0.25]), torch.tensor([0.2, 0.2]), torch.tensor([0.2, 0.2]))
    z0 = -5 * (-0.1 - 0.1)  # = 1.0 in every mode
    expected = {"sign": -5 * (0.1 + 0.05), "indicator": -5 * 0.1, "off": -5 * (0.1 - 0.05)}  # z of sample 1
    for mode, z1 in expected.items():
        loss, metrics = seppo_loss(*args, beta=10.0, aaf_mode=mode)
        want = (math.log1p(math.exp(-z0)) + math.log1p(math.exp(-z1))) / 2
        assert loss.item() == pytest.approx(want, abs=1e-6), mode
        assert metrics["flip_rate"].item() == (0.0 if mode == "off" else 0.5)
        assert metrics["implicit_acc"].item() == 0.5  # z0 > 0, z1 < 0
        assert metrics["rewards/margins"].item() == pytest.approx((z0 + z1) / 2, abs=1e-6)
        assert metrics["rewards/chosen"].item() == pytest.approx((0.5 - 0.5) / 2, abs=1e-6)  # r^w = 0.5, -0.5
        assert metrics["rewards/reference_sample"].item() == pytest.approx((-0.5 - 0.25) / 2, abs=1e-6)
        assert metrics["anchor_gap"].item() == pytest.approx(0.0, abs=1e-7)  # (0.1 + -0.1) / 2


def test_flipped_sample_is_pushed_like_a_winner():
    # dL/dℓθ(x^r) = -σ(-z) · s · β/2 · ... : s = +1 raises ℓθ(x^r) (loser), s = -1 lowers it (winner), s = 0 ignores it
    def grad_r(model_w: float, mode: str) -> float:
        model_r = torch.tensor([0.25], requires_grad=True)
        loss, _ = seppo_loss(torch.tensor([model_w]), model_r, torch.tensor([0.2]), torch.tensor([0.2]), 10.0, mode)
        loss.backward()
        return model_r.grad.item()

    z = -5 * (0.1 + 0.05)
    assert grad_r(0.3, "sign") == pytest.approx(5 / (1 + math.exp(z)), abs=1e-6)  # σ(-z)·β/2 > 0: lower ℓθ(x^r)
    assert grad_r(0.3, "indicator") == 0.0
    assert grad_r(0.1, "sign") < 0 and grad_r(0.1, "off") < 0


def test_anchor_flip_ties_and_modes():
    model_w, ref_w = torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0.2, 0.2, 0.2])
    assert anchor_flip(model_w, ref_w, "sign", "loser").tolist() == [1.0, 1.0, -1.0]
    assert anchor_flip(model_w, ref_w, "sign", "winner").tolist() == [1.0, -1.0, -1.0]
    assert anchor_flip(model_w, ref_w, "indicator", "loser").tolist() == [1.0, 1.0, 0.0]
    assert anchor_flip(model_w, ref_w, "off", "winner").tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="method.aaf_mode"):
        anchor_flip(model_w, ref_w, "always", "loser")


@pytest.mark.parametrize("kwargs,field", [
    ({"beta": 0}, "method.beta"), ({"aaf_mode": "flip"}, "method.aaf_mode"), ({"aaf_tie": "x"}, "method.aaf_tie"),
    ({"timestep_min": 10, "timestep_max": 5}, "method.timestep_max"), ({"sampler": {"name": "ddim", "eta": -1}}, "sampler.eta"),
    ({"sampler": {"name": "ddim", "num_inference_steps": 0}}, "sampler.num_inference_steps"),
    ({"sampler": {"name": "ddim", "guidance_scale": 0.5}}, "sampler.guidance_scale"), ({"sample_cache": "id"}, "method.sample_cache"),
])
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SePPO(**kwargs)


def test_configs_build_their_method():
    for config, cls in ((SePPOConfig, SePPO), (WinnerSFTConfig, WinnerSFT)):
        fields = [f for f in config.__dataclass_fields__ if f != "_target_"]
        assert config._target_ == f"{cls.__module__}.{cls.__qualname__}"
        built = cls(config(timestep_min=3))
        assert built.timestep_min == 3 and all(getattr(built, f) == getattr(config(), f) for f in fields
                                               if f != "timestep_min")
    assert SePPO.data_flow == "winners" and WinnerSFT.data_flow == "winners"


# ------------------------------------------------------------------------------------------- with the tiny model


def test_flipper_forced_to_plus_one_equals_diffusion_dpo_with_reference_sample_as_loser(perturb_lora):
    policy, pool = pool_policy(perturb_lora)
    batch = winner_batch(policy)
    seppo = SePPO(beta=500.0, aaf_mode="off", sample_seed=7, **SAMPLE)
    loss_s, metrics_s = seppo(policy, batch, generator=torch.Generator().manual_seed(3), reference=pool)
    loss_s.backward()
    grads_s = [p.grad.clone() for p in policy.trainable_parameters()]
    policy.unet.zero_grad(set_to_none=True)

    # x^r sampled independently by θ_r: DDIM rollouts under the pool's reference, one generator per prompt seeded with
    # the first 8 bytes of SHA-256("sample_seed/version/prompt") (the documented seed; version 1 = first stage)
    seeds = [int.from_bytes(hashlib.sha256(f"7/1/{p}".encode()).digest()[:8], "little") & (2**63 - 1) for p in PROMPTS]
    with pool.use(policy):
        trajectory = rollout(policy, PROMPTS,
                             step_sampler(policy, num_inference_steps=3, guidance_scale=2.0, noise=0.0), decode=False,
                             generator=[torch.Generator().manual_seed(s) for s in seeds])
    pairs = PreferenceBatch(batch.latents_w, trajectory.latents[:, -1], batch.prompts, batch.prompt_embeds, batch.ids)
    loss_d, metrics_d = DiffusionDPO(beta=500.0)(policy, pairs, generator=torch.Generator().manual_seed(3),
                                                 reference=pool)
    loss_d.backward()
    grads_d = [p.grad.clone() for p in policy.trainable_parameters()]

    assert abs(loss_s.item() - LN2) > 1e-4  # θ ≠ θ_r, so the comparison is not trivial
    torch.testing.assert_close(loss_s, loss_d, rtol=1e-6, atol=1e-7)
    assert metrics_s["implicit_acc"] == metrics_d["implicit_acc"]
    torch.testing.assert_close(metrics_s["rewards/margins"], metrics_d["rewards/margins"])
    torch.testing.assert_close(metrics_s["model_loss/reference_sample"], metrics_d["model_loss/rejected"])
    assert any(g.abs().sum() > 0 for g in grads_s)
    for g_s, g_d in zip(grads_s, grads_d):
        torch.testing.assert_close(g_s, g_d, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("aaf_mode", ["sign", "indicator"])
def test_first_step_loss_is_ln2(perturb_lora, aaf_mode):
    policy, pool = pool_policy(perturb_lora, policy_seed=None)  # policy = θ_0 = θ_r, a non-zero LoRA
    loss, metrics = SePPO(beta=5000.0, aaf_mode=aaf_mode, **SAMPLE)(
        policy, winner_batch(policy), generator=torch.Generator().manual_seed(0), reference=pool)
    assert loss.item() == pytest.approx(LN2, abs=1e-5)
    assert metrics["flip_rate"].item() == 0.0 and metrics["implicit_acc"].item() == 0.0  # tie: x^r a loser, z = 0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.trainable_parameters())


def test_reference_samples_cached_per_stage(perturb_lora):
    policy, pool = pool_policy(perturb_lora)
    seppo = SePPO(beta=100.0, **SAMPLE)
    prompts = ["a red circle", "a red circle", "two blue squares"]
    first, hits = seppo.reference_samples(policy, prompts, pool)
    assert hits == 0 and len(pool.samples) == 2  # one x^r per distinct prompt
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])
    again, hits = seppo.reference_samples(policy, prompts[1:], pool)
    assert hits == 2 and torch.equal(again, first[1:])
    pool.save_every = 1
    pool.on_step(policy, 1)  # new stage: cache emptied, new seeds
    assert len(pool.samples) == 0 and pool.version == 2
    fresh, hits = seppo.reference_samples(policy, prompts[:1], pool)
    assert hits == 0 and not torch.equal(fresh[0], first[0])


def test_cache_off_draws_fresh_samples(perturb_lora):
    policy, pool = pool_policy(perturb_lora)
    seppo = SePPO(beta=100.0, sample_cache="off", **SAMPLE)
    gen = torch.Generator().manual_seed(0)
    _, m1 = seppo(policy, winner_batch(policy), generator=gen, reference=pool)
    _, m2 = seppo(policy, winner_batch(policy), generator=gen, reference=pool)
    assert len(pool.samples) == 0 and m1["reference/cache_hits"] == 0
    assert m1["model_loss/reference_sample"] != m2["model_loss/reference_sample"]


def test_seppo_needs_a_reference(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    with pytest.raises(ValueError, match="reference"):
        SePPO(**SAMPLE)(policy, winner_batch(policy))


def test_winner_sft_is_the_mean_denoising_loss():
    policy = build_tiny_random_policy(seed=0)
    batch = winner_batch(policy)
    loss, _ = WinnerSFT()(policy, batch, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(4)
    t = torch.randint(0, 1000, (2,), generator=gen)
    noise = torch.randn(batch.latents_w.shape, generator=gen)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)[t].float().view(-1, 1, 1, 1)
    xt = abar.sqrt() * batch.latents_w + (1 - abar).sqrt() * noise
    with torch.no_grad():
        pred = policy.unet(xt, t, encoder_hidden_states=batch.prompt_embeds.prompt_embeds).sample
    assert loss.item() == pytest.approx(((pred - noise) ** 2).mean().item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------------ CLI runs


def _overrides(out: Path, steps: int) -> list[str]:
    return [f"output_dir={out}", "recipe=tiny_seppo", "model=tiny_random", f"trainer.max_steps={steps}",
            "trainer.batch_size=2", "trainer.checkpointing_steps=1", "trainer.keep_last=-1", "trainer.log_with=none",
            "eval.enabled=false", "data.num_samples=8", "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=1",
            "reference.save_every=2", "sampler.num_inference_steps=3"]


@pytest.mark.slow
def test_cli_two_step_tiny_seppo_run(tmp_path, monkeypatch, capsys):
    from diffalign import cli

    res = run_cli_in_process(cli.train, _overrides(tmp_path, 2), tmp_path, monkeypatch, capsys)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "reference pool" in res.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["global_step"] == 2
    first = results["history_tail"][0]
    assert first["loss"] == pytest.approx(LN2, abs=1e-5) and first["flip_rate"] == 0.0
    ref_state = json.loads((tmp_path / "checkpoint-2" / "reference_state.json").read_text())
    assert ref_state["strategy"] == "pool" and ref_state["snapshot_steps"] == [0] and ref_state["selected"] == 0


def test_resume_continues_exactly_with_the_pool(tmp_path):
    from conftest import compose_cfg

    from diffalign.train.preference import train

    train(compose_cfg(_overrides(tmp_path / "a", 4)))
    train(compose_cfg(_overrides(tmp_path / "b", 3)))  # stops mid-stage (snapshots at 0 and 2)
    train(compose_cfg(_overrides(tmp_path / "b", 4) + ["resume=latest"]))
    for name in ("final/pytorch_lora_weights.safetensors", "checkpoint-4/reference_state.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), name
    state_a = json.loads((tmp_path / "a" / "checkpoint-4" / "reference_state.json").read_text())
    state_b = json.loads((tmp_path / "b" / "checkpoint-4" / "reference_state.json").read_text())
    assert state_a == state_b and state_a["snapshot_steps"] == [0, 2] and state_a["drawn_at_step"] == 2
    assert len(state_a["samples"]["keys"]) > 0  # the stage's reference samples travel with the checkpoint
    state_a, state_b = (json.loads((tmp_path / run / "checkpoint-4" / "trainer_state.json").read_text()) for run in "ab")
    assert state_a.pop("lineage") != state_b.pop("lineage") and state_a == state_b  # (the lineage names the run)
