"""Rewards: DDPO JPEG (in)compressibility (arXiv:2305.13301 §6.1), WeightedSum, and batch-independent scores
(docs/guides/field_cases.md#rewards-do-not-depend-on-batch-composition)."""

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from diffalign.rewards.base import Reward, RewardError
from diffalign.rewards.compressibility import (
    JpegCompressibility,
    JpegCompressibilityConfig,
    JpegIncompressibility,
    JpegIncompressibilityConfig,
)
from diffalign.rewards.reward_set import WeightedSum
from diffalign.types import RewardOutput

PROMPTS = ["a red circle", "two blue squares", "a " + "very " * 68 + "yellow triangle", "x"]


def pil_jpeg_kb(array_hwc: np.ndarray, quality: int = 95) -> float:
    """Independent reference: PIL-encode a uint8 HWC array and return bytes / 1000."""
    buffer = io.BytesIO()
    Image.fromarray(array_hwc).save(buffer, format="JPEG", quality=quality)
    return len(buffer.getvalue()) / 1000.0


def uint8_images(n: int = 4, size: int = 32, seed: int = 0) -> np.ndarray:
    """(n, H, W, 3) uint8: a flat image, a gradient, a checkerboard and uniform noise."""
    rng = np.random.default_rng(seed)
    flat = np.full((size, size, 3), 120, np.uint8)
    ramp = np.linspace(0, 255, size, dtype=np.float64)
    gradient = np.stack([np.tile(ramp, (size, 1))] * 3, -1).round().astype(np.uint8)
    checker = ((np.indices((size, size)).sum(0) % 2) * 255).astype(np.uint8)[..., None].repeat(3, -1)
    noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    return np.stack([flat, gradient, checker, noise])[:n]


def to_tensor(arrays: np.ndarray) -> torch.Tensor:
    """uint8 (B, H, W, C) -> float (B, C, H, W) in [0, 1]; round(255·x) recovers the bytes exactly."""
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


# -------------------------------------------------------------------------------------------------- JPEG


def test_jpeg_scores_equal_independent_pil_sizes():
    arrays = uint8_images()
    expected = torch.tensor([pil_jpeg_kb(a) for a in arrays])
    comp = JpegCompressibility()(to_tensor(arrays), PROMPTS)
    incomp = JpegIncompressibility()(to_tensor(arrays), PROMPTS)
    assert comp.scores.dtype == torch.float32 and comp.scores.shape == (4,)
    torch.testing.assert_close(comp.scores, -expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(incomp.scores, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(comp.info["size_kb"], expected, rtol=0, atol=1e-6)


def test_jpeg_quality_is_passed_to_the_encoder():
    arrays = uint8_images()
    scores = JpegIncompressibility(quality=50)(to_tensor(arrays), PROMPTS).scores
    torch.testing.assert_close(scores, torch.tensor([pil_jpeg_kb(a, quality=50) for a in arrays]), rtol=0, atol=1e-6)
    assert scores[3] < JpegIncompressibility(quality=95)(to_tensor(arrays), PROMPTS).scores[3]


def test_flat_image_is_more_compressible_than_noise():
    arrays = uint8_images()
    flat, noise = to_tensor(arrays[[0]]), to_tensor(arrays[[3]])
    comp, incomp = JpegCompressibility(), JpegIncompressibility()
    assert comp(flat, ["p"]).scores.item() > comp(noise, ["p"]).scores.item()
    assert incomp(noise, ["p"]).scores.item() > incomp(flat, ["p"]).scores.item()


def test_video_scores_are_mean_frame_sizes():
    arrays = uint8_images()
    videos = torch.stack([to_tensor(arrays[[0, 3]]), to_tensor(arrays[[1, 2]])])  # (2, F=2, 3, 32, 32)
    expected = torch.tensor(
        [(pil_jpeg_kb(arrays[0]) + pil_jpeg_kb(arrays[3])) / 2, (pil_jpeg_kb(arrays[1]) + pil_jpeg_kb(arrays[2])) / 2]
    )
    torch.testing.assert_close(JpegIncompressibility()(videos, ["a", "b"]).scores, expected, rtol=0, atol=1e-6)


def test_jpeg_rejects_bad_inputs():
    reward = JpegCompressibility()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        reward(torch.full((1, 3, 8, 8), 1.5), ["p"])
    with pytest.raises(ValueError, match="non-finite"):
        reward(torch.full((1, 3, 8, 8), float("nan")), ["p"])
    with pytest.raises(ValueError, match="C in"):
        reward(torch.zeros(1, 4, 8, 8), ["p"])
    with pytest.raises(ValueError, match="reward.jpeg_compressibility.quality"):
        JpegCompressibility(quality=0)
    with pytest.raises(ValueError, match="reward.jpeg_incompressibility.quality"):
        JpegIncompressibility(quality=101)


def test_jpeg_classes_satisfy_protocol_and_configs():
    for cls, cfg in [
        (JpegCompressibility, JpegCompressibilityConfig),
        (JpegIncompressibility, JpegIncompressibilityConfig),
    ]:
        reward = cls(quality=cfg().quality)
        assert isinstance(reward, Reward)
        assert reward.differentiable is False and reward.name == cls.__name__.replace("Jpeg", "jpeg_").lower()
        assert cfg()._target_ == f"{cls.__module__}.{cls.__qualname__}"


# -------------------------------------------------------------------------------------------- WeightedSum


class ConstantPerImage:
    """Scores each image by the mean of its red channel; optionally fails or returns NaN."""

    differentiable = True
    name = "red"

    def __init__(self, mode: str = "ok"):
        self.mode = mode

    def __call__(self, images, prompts, metadata=None):
        if self.mode == "raise":
            raise RuntimeError("model server unreachable")
        scores = images[:, 0].mean(dim=(1, 2))
        if self.mode == "nan":
            scores = scores.clone()
            scores[1] = float("nan")
        if self.mode == "shape":
            scores = scores[:1]
        return RewardOutput(scores=scores, info={"raw": scores}, maps=images[:, 0])


def test_weighted_sum_combines_and_reports_components():
    images = to_tensor(uint8_images())
    combined = WeightedSum({"jpeg": JpegCompressibility(), "red": ConstantPerImage()}, {"jpeg": 0.5, "red": -2.0})
    out = combined(images, PROMPTS)
    jpeg = -torch.tensor([pil_jpeg_kb(a) for a in uint8_images()])
    red = torch.from_numpy(uint8_images()[..., 0].astype(np.float64)).mean(dim=(1, 2)).float() / 255.0
    torch.testing.assert_close(out.scores, 0.5 * jpeg - 2.0 * red, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.info["scores/jpeg"], jpeg, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.info["scores/red"], red, rtol=0, atol=1e-6)
    assert "jpeg/size_kb" in out.info and "red/raw" in out.info
    assert out.maps is None  # only one component has maps
    assert out.info["maps/red"].shape == (4, 32, 32)
    assert combined.differentiable is False and isinstance(combined, Reward)


def test_weighted_sum_combines_maps_when_all_have_them():
    images = to_tensor(uint8_images())
    out = WeightedSum({"a": ConstantPerImage(), "b": ConstantPerImage()}, {"a": 1.0, "b": 3.0})(images, PROMPTS)
    torch.testing.assert_close(out.maps, 4.0 * images[:, 0])
    assert out.info["scores/a"].shape == (4,) and WeightedSum({"a": ConstantPerImage()}, {"a": 1}).differentiable


@pytest.mark.parametrize(
    ("mode", "match"), [("raise", "model server unreachable"), ("nan", "non-finite"), ("shape", "shape")]
)
def test_weighted_sum_failure_names_the_reward(mode, match, caplog):
    combined = WeightedSum(
        {"jpeg": JpegCompressibility(), "flaky": ConstantPerImage(mode)}, {"jpeg": 1.0, "flaky": 1.0}
    )
    with (
        caplog.at_level(logging.ERROR, logger="diffalign.rewards.reward_set"),
        pytest.raises(RewardError, match=f"reward 'flaky'.*{match}") as info,
    ):
        combined(to_tensor(uint8_images()), PROMPTS)
    assert info.value.reward_name == "flaky"
    if mode != "shape":
        assert "flaky" in caplog.text


def test_weighted_sum_validates_weights():
    with pytest.raises(ValueError, match="one weight per selected reward"):
        WeightedSum({"a": ConstantPerImage()}, {"b": 1.0})
    with pytest.raises(ValueError, match="finite"):
        WeightedSum({"a": ConstantPerImage()}, {"a": float("inf")})
    with pytest.raises(ValueError, match="at least one"):
        WeightedSum({}, {})


# -------------------------------------------------------------------------------- no batch-composition effect


@pytest.mark.parametrize(
    "make_reward",
    [
        JpegCompressibility,
        JpegIncompressibility,
        lambda: WeightedSum(
            {"c": JpegCompressibility(), "i": JpegIncompressibility(quality=80)}, {"c": 1.0, "i": 0.3}
        ),
    ],
    ids=["jpeg_compressibility", "jpeg_incompressibility", "weighted_sum"],
)
def test_scores_do_not_depend_on_batch_composition(make_reward):
    reward = make_reward()
    images = to_tensor(uint8_images())
    batch_scores = reward(images, PROMPTS).scores
    single = torch.cat([reward(images[i : i + 1], PROMPTS[i : i + 1]).scores for i in range(4)])
    torch.testing.assert_close(batch_scores, single, rtol=0, atol=1e-4)
    perm = torch.tensor([2, 0, 3, 1])
    permuted = reward(images[perm], [PROMPTS[i] for i in perm]).scores
    torch.testing.assert_close(permuted, batch_scores[perm], rtol=0, atol=1e-4)
