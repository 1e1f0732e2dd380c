"""Rewards register themselves as methods do (issue 30, item 7): a reward file's config, decorated with
``config_schema("reward", name)``, is a ``reward=`` option with no entry point and no re-install. This module is such
a reward file; the built-in rewards are found the same way, and entry points stay for third-party packages
(tests/integration/test_external_plugin.py)."""

from __future__ import annotations

import ast
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg
from plugin_helpers import REAL_ENTRY_POINTS, fake_distribution, isolated_config_groups  # noqa: F401 - autouse

from diffalign.config import registry
from diffalign.config.schemas import config_schema
from diffalign.rewards.compressibility import JpegCompressibility
from diffalign.rewards.reward_set import build_reward, build_rewards
from diffalign.types import RewardOutput

REWARDS = Path(registry.__file__).resolve().parents[1] / "rewards"
# the built-in rewards diffalign 0.1.0's pyproject.toml declared as entry points (before they registered themselves)
ENTRY_POINT_REWARDS = {"brightness", "random_control", "jpeg_compressibility", "jpeg_incompressibility",
                       "geneval_shapes", "clip_score", "aesthetic", "pickscore", "hpsv2", "image_reward", "per_frame",
                       "temporal_consistency", "video_motion", "http"}
IMAGES = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


@config_schema("reward", "test_mean_red")
@dataclass
class MeanRedConfig:
    """Config of `MeanRed`."""

    _target_: str = f"{__name__}.MeanRed"
    scale: float = 1.0


class MeanRed:
    """scale · the mean of the red channel, `(B,)` float32."""

    differentiable = True
    name = "test_mean_red"

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, images, prompts, metadata=None) -> RewardOutput:
        return RewardOutput(scores=self.scale * images[:, 0].flatten(1).mean(1).float())


def reward_config_classes() -> set[str]:
    """``module:Class`` of every reward config dataclass in diffalign/rewards, read from the source: a class whose
    ``_target_`` default names a class of ``diffalign.rewards`` (the one-off ``python:`` template excepted)."""
    found = set()
    for path in sorted(REWARDS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef) or node.name == "PythonFunctionConfig":
                continue
            for item in node.body:
                target = isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "_target_"
                value = item.value.value if target and isinstance(item.value, ast.Constant) else ""
                if value.startswith("diffalign.rewards."):
                    found.add(f"diffalign.rewards.{path.stem}:{node.name}")
    return found


def with_entry_points(monkeypatch, *dists):
    """`importlib.metadata.entry_points` as an install of this checkout declares them (none of diffalign's own: an
    editable install made before the rewards registered themselves still lists them), plus those of `dists`."""

    def entry_points(*, group):
        real = [ep for ep in REAL_ENTRY_POINTS(group=group) if ep.dist is None or ep.dist.name != "diffalign"]
        return real + [ep for dist in dists for ep in dist.entry_points if ep.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_every_builtin_reward_file_registers_its_config_without_an_entry_point():
    registered = {name: config for name, config in registry.registered_reward_configs().items()
                  if config.__module__.startswith("diffalign.rewards.")}
    assert {f"{c.__module__}:{c.__qualname__}" for c in registered.values()} == reward_config_classes()
    assert set(registered) == ENTRY_POINT_REWARDS  # the same names as when they were entry points
    pyproject = (REWARDS.parents[1] / "pyproject.toml").read_text()
    assert "diffalign.rewards." not in pyproject.split('[project.entry-points')[-1].split("[tool.")[0]


def test_a_reward_registers_itself_from_its_own_file():
    assert "test_mean_red" not in {ep.name for ep in importlib.metadata.entry_points(group="diffalign.rewards")}
    assert registry.registered_reward_configs()["test_mean_red"] is MeanRedConfig
    assert "test_mean_red" in registry.reward_names()
    stored = registry.register_configs()
    assert "test_mean_red" in stored["reward"] and "test_mean_red" in stored["eval_reward"]

    cfg = compose_cfg(["reward=[test_mean_red,jpeg_compressibility]", "reward.test_mean_red.scale=2.0",
                       "reward.test_mean_red.weight=0.5"])
    assert cfg.reward.test_mean_red.scale == 2.0
    out = build_rewards(cfg.reward)(IMAGES, ["a", "b"])
    red = 2.0 * IMAGES[:, 0].flatten(1).mean(1)  # by hand: scale x the red channel's mean
    torch.testing.assert_close(out.info["scores/test_mean_red"], red)
    torch.testing.assert_close(out.scores, 0.5 * red + JpegCompressibility()(IMAGES, ["a", "b"]).scores)
    assert build_reward("test_mean_red", scale=3.0).scale == 3.0


def test_an_entry_point_may_not_take_a_registered_rewards_name(tmp_path, monkeypatch):
    dist = fake_distribution(tmp_path, "someone-elses-rewards",
                             "[diffalign.rewards]\nbrightness = other_pkg.rewards:BrightnessConfig\n")
    with_entry_points(monkeypatch, dist)
    with pytest.raises(ValueError, match="'brightness'.*someone-elses-rewards.*diffalign.rewards.brightness"):
        registry.register_configs()
    with pytest.raises(ValueError, match="takes the name of diffalign's reward"):
        registry.reward_names()


def test_an_entry_point_naming_the_registered_config_itself_is_the_same_reward(tmp_path, monkeypatch):
    """An install made while diffalign declared its rewards as entry points still lists them: the same reward."""
    dist = fake_distribution(tmp_path, "diffalign",
                             "[diffalign.rewards]\nbrightness = diffalign.rewards.brightness:BrightnessConfig\n")
    with_entry_points(monkeypatch, dist)
    assert registry.register_configs()["reward"].count("brightness") == 1
    assert registry.reward_config("brightness").__module__ == "diffalign.rewards.brightness"
