"""Entry-point plugins → Hydra ConfigStore, multi-select rewards, and a third-party reward end to end."""

import dataclasses
import importlib.metadata
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError
from plugin_helpers import REAL_ENTRY_POINTS, add_entry_points, fake_distribution, isolated_config_groups  # noqa: F401

from diffalign.config import registry
from diffalign.rewards import reward_set
from diffalign.rewards.base import Reward
from diffalign.rewards.compressibility import JpegCompressibility, JpegCompressibilityConfig, JpegIncompressibility
from diffalign.rewards.reward_set import CheckedReward, WeightedSum

# built-in rewards whose defaults need downloaded weights, and what their error says
NEEDS_WEIGHTS = {
    "aesthetic": "reward.aesthetic.head is required",
    "hpsv2": "reward.hpsv2.weights is required",
    "pickscore": "reward.pickscore.model.*HF_HUB_OFFLINE",
    "image_reward": r"diffalign\[imagereward\]",
    "http": "reward.http.url is required",  # the reward server's address (no default server)
}
IMAGES = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))

PLUGIN_SOURCE = textwrap.dedent(
    '''
    from dataclasses import dataclass

    import torch

    from diffalign.types import RewardOutput


    class Brightness:
        """Third-party reward: scale · mean pixel value."""

        differentiable = True
        name = "brightness"

        def __init__(self, scale: float = 1.0):
            self.scale = scale

        def __call__(self, images, prompts, metadata=None):
            return RewardOutput(scores=self.scale * images.flatten(1).mean(1).float())


    @dataclass
    class BrightnessConfig:
        _target_: str = "diffalign_test_plugin.Brightness"
        scale: float = 1.0
    '''
)


@pytest.fixture
def config_dir(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "config.yaml").write_text("defaults:\n  - _self_\n  - reward: [jpeg_compressibility]\n\nseed: 0\n")
    return conf


def test_builtin_rewards_are_discovered():
    configs = registry.registered_reward_configs()
    assert configs["jpeg_compressibility"] is JpegCompressibilityConfig
    assert {"jpeg_compressibility", "jpeg_incompressibility"} <= set(configs)


@pytest.mark.parametrize("name", sorted(n for n, c in registry.registered_reward_configs().items()
                                        if c.__module__.startswith("diffalign.rewards.")))
def test_config_fields_match_init_signature(name):
    config_class = registry.reward_config(name)
    fields = {f.name: f for f in dataclasses.fields(config_class) if f.name != "_target_"}
    reward_class = get_class(config_class._target_)
    params = {n: p for n, p in inspect.signature(reward_class.__init__).parameters.items() if n != "self"}
    assert set(fields) == set(params), f"{config_class.__name__} fields {sorted(fields)} vs __init__ {sorted(params)}"
    for field_name, field in fields.items():
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        assert default == params[field_name].default, field_name
    if name in NEEDS_WEIGHTS:  # defaults name real weights that are absent here (HF_HUB_OFFLINE=1, no cache)
        with pytest.raises(InstantiationException, match=NEEDS_WEIGHTS[name]):
            reward_set.build_reward(name)
    else:
        assert isinstance(reward_set.build_reward(name), Reward)


def test_multiselect_rewards_nest_under_their_names(config_dir):
    registry.register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        default = compose("config")
        both = compose(
            "config",
            overrides=[
                "reward=[jpeg_compressibility,jpeg_incompressibility]",
                "reward.jpeg_incompressibility.quality=80",
            ],
        )
    assert list(default.reward) == ["jpeg_compressibility"]
    assert default.reward.jpeg_compressibility.quality == 95
    assert list(both.reward) == ["jpeg_compressibility", "jpeg_incompressibility"]
    assert both.reward.jpeg_incompressibility.quality == 80 and both.reward.jpeg_compressibility.quality == 95
    assert "quality" not in both.reward  # options did not merge into one node

    combined = reward_set.build_rewards(both.reward,
                                        weights={"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.5})
    assert isinstance(combined, WeightedSum)
    guarded = combined.rewards["jpeg_incompressibility"]  # build -> guard -> combine
    assert isinstance(guarded, CheckedReward) and isinstance(guarded.reward, JpegIncompressibility)
    assert combined.rewards["jpeg_incompressibility"].quality == 80
    expected = (
        JpegCompressibility()(IMAGES, ["a", "b"]).scores + 0.5 * JpegIncompressibility(80)(IMAGES, ["a", "b"]).scores
    )
    torch.testing.assert_close(combined(IMAGES, ["a", "b"]).scores, expected)


def test_register_configs_stores_groups_with_packages():
    stored = registry.register_configs()
    assert "jpeg_compressibility" in stored["reward"] and set(stored) == {"reward", "eval_reward", "model", "method"}
    assert stored["eval_reward"] == stored["reward"]
    for group in ("reward", "eval_reward"):
        node = ConfigStore.instance().load(f"{group}/jpeg_compressibility.yaml")
        assert node.package == f"{group}.jpeg_compressibility"
        assert OmegaConf.to_container(node.node) == {"_target_": JpegCompressibilityConfig._target_, "quality": 95,
                                                     "weight": 1.0, "normalize": "none"}


def test_third_party_reward_end_to_end(tmp_path, monkeypatch, config_dir):
    (tmp_path / "diffalign_test_plugin.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = fake_distribution(
        tmp_path, "diffalign-test-plugin", "[diffalign.rewards]\npixel_mean = diffalign_test_plugin:BrightnessConfig\n"
    )
    add_entry_points(monkeypatch, dist)

    assert registry.register_configs()["reward"].count("pixel_mean") == 1
    assert ConfigStore.instance().load("reward/pixel_mean.yaml").provider == "diffalign-test-plugin"
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose("config", overrides=["reward=[pixel_mean,jpeg_compressibility]", "reward.pixel_mean.scale=3.0"])
    assert cfg.reward.pixel_mean.scale == 3.0

    combined = reward_set.build_rewards(cfg.reward)
    out = combined(IMAGES, ["a", "b"])
    brightness = 3.0 * IMAGES.flatten(1).mean(1)
    torch.testing.assert_close(out.info["scores/pixel_mean"], brightness)
    torch.testing.assert_close(out.scores, brightness + JpegCompressibility()(IMAGES, ["a", "b"]).scores)
    assert reward_set.build_reward("pixel_mean", scale=2.0).scale == 2.0
    assert reward_set.build_rewards({"pixel_mean": None}).rewards["pixel_mean"].scale == 1.0


def test_duplicate_entry_point_names_raise_naming_both(tmp_path, monkeypatch):
    first = fake_distribution(tmp_path, "first-dist", "[diffalign.rewards]\nclip = a.mod:ClipConfig\n")
    second = fake_distribution(tmp_path, "second-dist", "[diffalign.rewards]\nclip = b.mod:OtherClipConfig\n")
    add_entry_points(monkeypatch, first, second)
    with pytest.raises(ValueError, match="'clip'.*first-dist.*second-dist"):
        registry.register_configs()
    with pytest.raises(ValueError, match="first-dist.*second-dist"):
        registry.entry_point_configs()


def test_unknown_reward_lists_available():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*jpeg_compressibility"):
        reward_set.build_reward("nope")
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*jpeg_incompressibility"):
        reward_set.build_rewards({"nope": {}})


def test_build_rewards_validates_fields_and_weights():
    with pytest.raises(ConfigKeyError, match="qualty"):
        reward_set.build_rewards({"jpeg_compressibility": {"qualty": 3}})
    with pytest.raises(ValueError, match="one weight per selected reward"):
        reward_set.build_rewards({"jpeg_compressibility": {}}, weights={"jpeg_incompressibility": 1.0})
    with pytest.raises(ValueError, match="no reward selected"):
        reward_set.build_rewards({})
    with pytest.raises(InstantiationException, match="reward.jpeg_compressibility.quality"):
        reward_set.build_reward("jpeg_compressibility", quality=0)


def test_unloadable_entry_point_names_it(tmp_path, monkeypatch):
    dist = fake_distribution(tmp_path, "broken-dist", "[diffalign.rewards]\nbroken = not_a_module_xyz:Config\n")
    add_entry_points(monkeypatch, dist)
    with pytest.raises(ImportError, match="'broken'.*not_a_module_xyz"):
        reward_set.build_reward("broken")
    assert isinstance(reward_set.build_reward("jpeg_compressibility"), JpegCompressibility)  # others still load


def test_a_broken_third_party_plugin_is_skipped_with_a_warning(monkeypatch):

    from diffalign.config import registry

    real = registry.entry_points

    class Dist:
        name = "someone-elses-rewards"

    def with_broken(group):
        eps = dict(real(group))
        if group == "diffalign.rewards":
            ep = importlib.metadata.EntryPoint("broken_reward", "no_such_module_xyz:Config", group)
            object.__setattr__(ep, "dist", Dist())
            eps["broken_reward"] = ep
        return eps

    monkeypatch.setattr(registry, "entry_points", with_broken)
    with pytest.warns(UserWarning, match="broken_reward.*someone-elses-rewards"):
        stored = registry.register_configs()
    assert "broken_reward" not in stored["reward"] and "geneval_shapes" in stored["reward"]


# ------------------------------------------------------------------------------ the extending guide's plugin example

EXTENDING = Path(__file__).resolve().parents[3] / "docs" / "guides" / "extending.md"


def _fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_the_extending_guide_documents_every_entry_point_group_the_registry_reads():
    """Each group `register_configs` reads (`registry.GROUPS`) has a ``[project.entry-points."<group>"]`` example in
    docs/guides/extending.md (diffalign.models and diffalign.methods had none)."""
    documented = set(re.findall(r'^\[project\.entry-points\."([^"]+)"\]', EXTENDING.read_text(),
                                flags=re.MULTILINE))
    assert documented == set(registry.GROUPS)


def test_the_extending_guide_plugin_trains(tmp_path, monkeypatch):
    """The guide's ``my_pkg`` (its Python block, as written) declared with its TOML block as a package's entry points:
    ``method=winner_denoise model=my_sd`` compose from the entry points alone, its provider is the package, its own
    ``check_config`` runs before any model loads, and two steps on the tiny world's SD model move the LoRA."""
    from conftest import compose_cfg, smoke_overrides
    from safetensors.torch import load_file

    from diffalign.config.compose import asset_path
    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    text = EXTENDING.read_text()
    (source,) = [b for b in _fenced_blocks(text, "python") if b.startswith("# my_pkg/__init__.py")]
    (toml,) = [b for b in _fenced_blocks(text, "toml") if "diffalign.methods" in b]
    (tmp_path / "src" / "my_pkg").mkdir(parents=True)
    (tmp_path / "src" / "my_pkg" / "__init__.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.delitem(sys.modules, "my_pkg", raising=False)  # (and removed again when the test ends)
    monkeypatch.setitem(sys.modules, "my_pkg", importlib.import_module("my_pkg"))
    # the TOML's tables as a dist-info entry_points.txt: [project.entry-points."g"] -> [g], name = "v" -> name = v
    entry_points_txt = re.sub(r'^\[project\.entry-points\."([^"]+)"\]$', r"[\1]", toml, flags=re.MULTILINE)
    entry_points_txt = re.sub(r'^(\w+) = "([^"]+)"$', r"\1 = \2", entry_points_txt, flags=re.MULTILINE)
    add_entry_points(monkeypatch, fake_distribution(tmp_path, "my-pkg", entry_points_txt))

    run = tmp_path / "run"
    overrides = [o for o in smoke_overrides(run, steps=2) if not o.startswith(("data.", "model="))]
    overrides += ["method=winner_denoise", "model=my_sd", f"model.pretrained_model_name_or_path={asset_path('tiny_sd')}",
                  "data=shapes_winners", "data.num_samples=8"]
    cfg = compose_cfg(overrides)
    assert ConfigStore.instance().load("method/winner_denoise.yaml").provider == "my-pkg"
    assert (cfg.method._target_, cfg.model._target_) == (
        "my_pkg.WinnerDenoise", "diffalign.models.stable_diffusion.StableDiffusionPolicy.from_pretrained")
    with pytest.raises(ValueError, match=r"method.timestep=1000 must be in \[0, 1000\)"):
        validate_train_config(compose_cfg(overrides + ["method.timestep=1000", f"output_dir={tmp_path / 'bad'}"]))
    validate_train_config(cfg)
    results = train(cfg)
    first = load_file(run / "checkpoint-1" / "pytorch_lora_weights.safetensors")
    final = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert results["global_step"] == 2 and any(not torch.equal(first[k], final[k]) for k in first)
