"""The speed-ups of the main job keep its results: LoRA folded out of no-grad sampling (skipped when zero, fused and
restored exactly otherwise), winners' latents encoded once per run, the base evaluation reused from an identical earlier
one (docs/guides/performance.md)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from conftest import perturb_lora_, step_sampler

import diffalign.evaluation.evaluate as evaluate_module
from diffalign.evaluation.evaluate import evaluate_policy
from diffalign.evaluation.generation import EvalConfig
from diffalign.models.base import inference_lora
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.samplers.rollout import rollout
from diffalign.train.preference import LatentCache, data_latents
from diffalign.types import RewardOutput

CONV_AND_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2")


def _unet_inputs(policy, batch: int = 3):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *policy.latent_shape, generator=g)
    e = torch.randn(batch, 77, policy.unet.config.cross_attention_dim, generator=g)
    return x, torch.tensor(500), e


def _lora_delta_by_hand(policy) -> dict[str, torch.Tensor]:
    """W + (alpha/r) B A of every adapted layer, computed from the raw matrices (a conv's A is a k x k conv to r
    channels and B a 1 x 1 conv back, so B A is the matrix product over the rank axis)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, layer in policy.unet.named_modules():
        if isinstance(layer, LoraLayer):
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
            scale = layer.scaling["default"]
            base = layer.get_base_layer().weight
            if a.ndim == 4:  # conv: B (out, r, 1, 1) x A (r, in, k, k)
                delta = torch.einsum("or,rikl->oikl", b[:, :, 0, 0], a)
            else:
                delta = b @ a
            out[name] = base + scale * delta
    return out


def test_a_zero_adapter_is_skipped_and_gives_bit_identical_outputs():
    policy = build_tiny_random_policy(seed=0, lora_target_modules=CONV_AND_ATTENTION)  # fresh LoRA: B = 0
    x, t, e = _unet_inputs(policy)
    with torch.no_grad():
        adapted = policy.unet(x, t, encoder_hidden_states=e).sample
        with inference_lora(policy.unet) as what:
            assert what == "skipped"
            assert all(layer.disable_adapters for layer in evaluate_module_lora_layers(policy))
            skipped = policy.unet(x, t, encoder_hidden_states=e).sample
    assert torch.equal(adapted, skipped)
    assert not any(layer.disable_adapters for layer in evaluate_module_lora_layers(policy))
    assert all(p.requires_grad for p in policy.trainable_parameters())


def evaluate_module_lora_layers(policy):
    from peft.tuners.lora import LoraLayer

    return [m for m in policy.unet.modules() if isinstance(m, LoraLayer)]


def test_a_trained_adapter_is_fused_by_hand_and_the_base_weights_come_back_exactly():
    policy = build_tiny_random_policy(seed=0, lora_target_modules=CONV_AND_ATTENTION)
    perturb_lora_(policy, std=0.1)
    expected = _lora_delta_by_hand(policy)
    before = {k: v.clone() for k, v in policy.unet.state_dict().items()}
    x, t, e = _unet_inputs(policy)
    with torch.no_grad():
        adapted = policy.unet(x, t, encoder_hidden_states=e).sample
        with inference_lora(policy.unet) as what:
            assert what == "fused"
            for name, layer in policy.unet.named_modules():
                if name in expected:  # the fused weight is W + (alpha/r) B A
                    torch.testing.assert_close(layer.get_base_layer().weight, expected[name], rtol=0, atol=1e-6)
            fused = policy.unet(x, t, encoder_hidden_states=e).sample
    torch.testing.assert_close(fused, adapted, rtol=0, atol=1e-4)  # same function, summed in another order
    after = policy.unet.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # restored bit for bit (peft's unmerge drifts)
    assert all(p.requires_grad for p in policy.trainable_parameters())


def test_inference_lora_restores_the_weights_when_the_block_raises_and_leaves_a_disabled_adapter_alone():
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy)
    before = {k: v.clone() for k, v in policy.unet.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), inference_lora(policy.unet):
        raise RuntimeError("boom")
    assert all(torch.equal(before[k], v) for k, v in policy.unet.state_dict().items())
    assert not any(layer.disable_adapters for layer in evaluate_module_lora_layers(policy))
    with policy.reference(), inference_lora(policy.unet) as what:  # the base model: nothing to fold
        assert what == "unchanged"
    with inference_lora(policy.unet, fuse=False) as what:  # a trained adapter without fusing runs as it is
        assert what == "unchanged"


def test_rollout_skips_only_a_zero_adapter_unless_asked_to_fuse(monkeypatch):
    policy = build_tiny_random_policy(seed=0)
    seen = []
    real = inference_lora

    def spy(denoiser, fuse=True):
        ctx = real(denoiser, fuse=fuse)

        class Wrapped:
            def __enter__(self):
                seen.append(ctx.__enter__())
                return seen[-1]

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(sys.modules["diffalign.samplers.base"], "inference_lora", spy)
    sampler = step_sampler(policy, num_inference_steps=2, guidance_scale=2.0, noise=1.0)
    a = rollout(policy, ["a red circle"], sampler, generator=torch.Generator().manual_seed(0))
    perturb_lora_(policy)
    b = rollout(policy, ["a red circle"], sampler, generator=torch.Generator().manual_seed(0))
    c = rollout(policy, ["a red circle"], sampler, generator=torch.Generator().manual_seed(0), fuse_lora=True)
    rollout(policy, ["a red circle"], sampler, generator=torch.Generator().manual_seed(0), enable_grad=True)
    assert seen == ["skipped", "unchanged", "fused"]  # no folding with gradients
    assert not torch.equal(a.images, b.images)
    torch.testing.assert_close(c.images, b.images, rtol=0, atol=1e-4)
    torch.testing.assert_close(c.log_probs, b.log_probs, rtol=0, atol=1e-3)


class CountingPolicy:
    """Wraps a policy and counts the images `encode_images` receives."""

    def __init__(self, policy):
        self.policy, self.encoded = policy, 0

    def encode_images(self, images):
        self.encoded += images.shape[0]
        return self.policy.encode_images(images)


def test_latent_cache_encodes_each_item_once_and_returns_the_same_latents():
    policy = build_tiny_random_policy(seed=0)
    g = torch.Generator().manual_seed(0)
    images = {side: torch.rand(6, 3, 32, 32, generator=g) for side in ("w", "l")}
    counting = CountingPolicy(policy)
    cache = LatentCache(6, 4 * 4 * 4)
    for indices in ([0, 1, 2], [2, 3, 4], [4, 5, 0], [1, 3, 5]):
        batch = {f"images_{s}": images[s][indices] for s in ("w", "l")}
        for side in ("w", "l"):
            got = cache.latents(counting, batch, side, indices, "cpu")
            torch.testing.assert_close(got, data_latents(policy, batch, side, "cpu"), rtol=0, atol=1e-5)
    assert counting.encoded == 12  # 6 items x 2 sides, each encoded once over the four batches
    given = {"latents_w": torch.ones(2, 4, 4, 4), "images_w": images["w"][:2]}
    assert torch.equal(cache.latents(counting, given, "w", [7, 8], "cpu"), given["latents_w"])  # passes through
    assert not LatentCache(10**6, 4 * 64 * 64, max_bytes=2 * 1024**3).enabled  # 62 GiB of latents: not cached
    assert not LatentCache(6, 64, enabled=False).enabled


class StoredPairs:
    """A data set of fixed images: ``collate`` stacks the rows at the given indices."""

    def __init__(self, images):
        self.images = images

    def collate(self, indices):
        return {f"images_{s}": self.images[s][list(indices)] for s in ("w", "l")}


class BatchRecordingPolicy(CountingPolicy):
    """Also records which images each `encode_images` call received (to compare the sub-batches)."""

    def __init__(self, policy):
        super().__init__(policy)
        self.calls = []

    def encode_images(self, images):
        self.calls.append(images.clone())
        return super().encode_images(images)


def test_latent_cache_refill_encodes_in_the_batches_the_uninterrupted_run_did():
    """A resumed run refills its cache over the batches drawn before the resume: the same sub-batches reach the VAE,
    in the same order, so every cached latent is bit for bit the uninterrupted run's."""
    policy = build_tiny_random_policy(seed=0)
    g = torch.Generator().manual_seed(0)
    data = StoredPairs({side: torch.rand(6, 3, 32, 32, generator=g) for side in ("w", "l")})
    batches = [[0, 1, 2], [2, 3, 4], [4, 5, 0]]
    live, replayed = BatchRecordingPolicy(policy), BatchRecordingPolicy(policy)
    first, second = LatentCache(6, 4 * 4 * 4), LatentCache(6, 4 * 4 * 4)
    for indices in batches:  # the uninterrupted run: `latents` as the batches come
        for side in ("w", "l"):
            first.latents(live, data.collate(indices), side, indices, "cpu")
    assert second.refill(replayed, data, batches, ("w", "l"), "cpu") == 12
    assert [c.shape[0] for c in replayed.calls] == [3, 3, 2, 2, 1, 1]  # new items only, batch by batch, w then l
    assert all(torch.equal(a, b) for a, b in zip(live.calls, replayed.calls, strict=True))
    for side in ("w", "l"):
        assert torch.equal(first.latents(live, data.collate(range(6)), side, list(range(6)), "cpu"),
                           second.latents(replayed, data.collate(range(6)), side, list(range(6)), "cpu"))
    assert second.refill(replayed, data, batches, ("w",), "cpu") == 0  # nothing left to encode
    assert LatentCache(6, 64, enabled=False).refill(replayed, data, batches, ("w",), "cpu") == 0


class MeanReward:
    def __init__(self):
        self.calls = 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        return RewardOutput(scores=images.float().flatten(1).mean(1))


ROWS = [{"prompt": "a red circle", "tag": "colors"}, {"prompt": "two squares", "tag": "counting"}]


def _count_samples(monkeypatch) -> list[int]:
    calls = []
    real = evaluate_module.sample_images

    def counting(policy, jobs, rows, cfg, use_reference):
        calls.append((use_reference, len(jobs)))
        return real(policy, jobs, rows, cfg, use_reference)

    monkeypatch.setattr(evaluate_module, "sample_images", counting)
    return calls


def test_the_base_evaluation_of_a_sibling_run_is_reused_only_when_identical(tmp_path, monkeypatch):
    cfg = EvalConfig(seeds=[0, 1], sampler={"name": "ode", "num_inference_steps": 2}, batch_size=4)
    key = {"model": {"num_frames": 8}, "rewards": {"mean": {}}}  # what `base_reuse_key` gives
    first_policy = build_tiny_random_policy(seed=0, lora_target_modules=CONV_AND_ATTENTION)  # another LoRA: reused
    first = evaluate_policy(first_policy, ROWS, {"mean": MeanReward()}, cfg, tmp_path / "runs" / "a" / "eval",
                            {"base": True}, progress=False, base_key=key)
    calls = _count_samples(monkeypatch)
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy)
    logs = []
    second = evaluate_policy(policy, ROWS, {"mean": MeanReward()}, cfg, tmp_path / "runs" / "b" / "eval",
                             {"base": True, "finetuned": False}, progress=False, log=logs.append, base_key=key)
    assert calls == [(False, 4)]  # only the fine-tuned model was sampled
    assert any("reusing the identical base evaluation" in line for line in logs)
    assert second["variants"]["base"] == first["variants"]["base"]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "b" / "eval" / "samples.jsonl").read_text().splitlines()]
    assert all((tmp_path / "runs" / "b" / "eval" / r["image"]).is_file() for r in rows)  # copied, not referenced
    # another base model (one frozen weight changed), other seeds, or reuse switched off: sampled again
    other = build_tiny_random_policy(seed=0)
    with torch.no_grad():
        other.unet.conv_in.bias.add_(1e-3)
    evaluate_policy(other, ROWS, {"mean": MeanReward()}, cfg, tmp_path / "runs" / "c" / "eval", {"base": True},
                    progress=False, base_key=key)
    evaluate_policy(policy, ROWS, {"mean": MeanReward()}, dataclasses.replace(cfg, seeds=[0, 2]),
                    tmp_path / "runs" / "d" / "eval", {"base": True}, progress=False, base_key=key)
    evaluate_policy(policy, ROWS, {"mean": MeanReward()}, dataclasses.replace(cfg, reuse_base=False),
                    tmp_path / "runs" / "e" / "eval", {"base": True}, progress=False, base_key=key)
    # other model settings (a video's frame count) or reward settings (binary score), or no key: sampled again
    for n, other_key in enumerate(({"model": {"num_frames": 4}, "rewards": {"mean": {}}},
                                   {"model": {"num_frames": 8}, "rewards": {"mean": {"score": "binary"}}}, None)):
        evaluate_policy(policy, ROWS, {"mean": MeanReward()}, cfg, tmp_path / "runs" / f"f{n}" / "eval",
                        {"base": True}, progress=False, base_key=other_key)
    assert calls[1:] == [(True, 4)] * 6
