"""Renamed config keys (issue 18 item 7): the field's standard names, with the old keys still working until 0.3 through
one helper (`diffalign.config.deprecation.migrate_config`): a FutureWarning naming the old key, the new key and the
value carried over; an old key and its new key set together is an error naming both."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg, online_overrides
from safetensors.torch import load_file

from diffalign.config.deprecation import migrate_config


def migrated(overrides: list[str]):
    """The composed config after `migrate_config` (given the overrides, as the CLI does), and its warnings."""
    cfg = compose_cfg(overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        migrate_config(cfg, overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("overrides,key,value,old", [
    (["recipe=tiny_dgpo", "method.num_train_timesteps=2"], "method.timesteps_per_epoch", 2,
     "method.num_train_timesteps"),
])
def test_an_old_key_is_carried_over_with_a_warning_naming_old_and_new(overrides, key, value, old):
    cfg, said = migrated(overrides)
    group, field = key.split(".")
    assert cfg[group][field] == value
    assert len(said) == 1 and old in said[0] and key in said[0] and repr(value) in said[0]


def test_the_new_key_alone_gives_no_warning_and_the_alias_is_dropped():
    cfg, said = migrated(["recipe=tiny_dgpo", "method.timesteps_per_epoch=2"])
    assert said == [] and "num_train_timesteps" not in cfg.method


@pytest.mark.parametrize("overrides", [
    ["recipe=tiny_flow_grpo", "sampler.eta=0.5"], ["recipe=tiny_flow_grpo", "sampler.sde_type=dance"],
    ["recipe=tiny_dgpo", "sampler.eta=0"],
])
def test_the_removed_sampler_aliases_are_refused_by_name(overrides):
    """The sampler keys deprecated until 0.3 are gone: a flow SDE's noise is sampler.noise_level, each SDE its own
    option (docs/methods/algorithms.md#renamed-config-keys)."""
    from hydra.errors import ConfigCompositionException

    key = overrides[-1].split("=")[0]
    with pytest.raises(ConfigCompositionException, match=rf"Could not override '{key}'"):
        compose_cfg(overrides)


@pytest.mark.parametrize("overrides", [
    ["recipe=tiny_dgpo", "method.num_train_timesteps=2", "method.timesteps_per_epoch=3"],
])
def test_setting_an_old_key_and_its_new_key_is_an_error_naming_both(overrides):
    old, new = (o.split("=")[0] for o in overrides[1:])
    with pytest.raises(ValueError, match=rf"{old} and {new} are both set"):
        migrated(overrides)


def test_the_loops_migrate_an_old_key_and_train_exactly_as_with_the_new_one(tmp_path):
    from diffalign.train.online import train

    case = ["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2"]
    train(compose_cfg(case + ["method.timesteps_per_epoch=2"] + online_overrides(tmp_path / "new", epochs=1)))
    with pytest.warns(FutureWarning, match="method.num_train_timesteps.*method.timesteps_per_epoch=2"):
        train(compose_cfg(case + ["method.num_train_timesteps=2"] + online_overrides(tmp_path / "old", epochs=1)))
    lora = [load_file(Path(tmp_path) / run / "final" / "pytorch_lora_weights.safetensors") for run in ("new", "old")]
    assert all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])


def test_the_command_warns_about_an_old_key_and_refuses_it_beside_its_new_one(tmp_path):
    """Through ``diffalign-train`` (the overrides come from Hydra): the warning names both keys and the value, and
    both keys on the command line stop the run before any model loads."""
    import subprocess
    import sys

    from conftest import CHILD_ENV

    def cli(*args: str) -> subprocess.CompletedProcess:
        code = "import sys; from diffalign.cli import train; sys.argv = ['diffalign-train'] + sys.argv[1:]; train()"
        return subprocess.run([sys.executable, "-c", code, "recipe=tiny_dgpo", f"output_dir={tmp_path}", *args],
                              check=False, capture_output=True, text=True, cwd=tmp_path, env=CHILD_ENV,
                              timeout=300)

    old = cli("method.num_train_timesteps=3", "trainer.learning_rate=0")  # stops at the validation, after the warning
    assert old.returncode != 0 and "trainer.learning_rate must be a number > 0" in old.stderr
    assert "FutureWarning: method.num_train_timesteps is deprecated" in old.stderr
    assert "method.timesteps_per_epoch=3" in old.stderr
    both = cli("method.num_train_timesteps=3", "method.timesteps_per_epoch=2")
    assert both.returncode != 0
    assert "method.num_train_timesteps and method.timesteps_per_epoch are both set" in both.stderr


def test_a_migrated_node_keeps_its_types_and_loses_only_the_old_keys():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from diffalign.objectives.dgpo import DGPOConfig

    cfg, _ = migrated(["recipe=tiny_dgpo", "method.num_train_timesteps=3"])
    assert OmegaConf.get_type(cfg.method).__name__ == DGPOConfig.__name__
    assert list(cfg.method) == [k for k in DGPOConfig.__dataclass_fields__ if k != "num_train_timesteps"]
    with pytest.raises(ValidationError):  # still type-checked, as before the migration
        cfg.method.beta = "large"
