"""A new method is one objective file and one config, with no central edit: this module is the objective file (its
config registers itself with `diffalign.config.schemas.config_schema`), a YAML option written into a folder on Hydra's
search path is the config, and the preference loop trains it through the method contract alone."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from conftest import compose_cfg, smoke_overrides
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file

from diffalign.config.schemas import config_schema, discover
from diffalign.objectives.common import per_sample_mse
from diffalign.types import WinnerBatch


@config_schema("method", "dummy_denoise")
@dataclass
class DummyDenoiseConfig:
    """Config of `DummyDenoise`."""

    _target_: str = f"{__name__}.DummyDenoise"
    timestep: int = 500
    weight: float = 1.0


class DummyDenoise(torch.nn.Module):
    """The denoising loss of the winners at one fixed timestep, times `weight` (data flow "winners")."""

    data_flow = "winners"

    def __init__(self, timestep: int = 500, weight: float = 1.0):
        super().__init__()
        if weight <= 0:
            raise ValueError(f"method.weight={weight} must be > 0")
        self.timestep, self.weight = timestep, weight

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        if cfg.method.timestep >= 1000:
            raise ValueError(f"method.timestep={cfg.method.timestep} must be < 1000")

    def setup(self, policy) -> None:
        pass

    def checkpoint_states(self) -> dict:
        return {}

    def forward(self, policy, batch: WinnerBatch, generator=None, reference=None):
        latents = batch.latents_w
        noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in generator]).to(latents)
        t = torch.full((len(latents),), self.timestep, dtype=torch.long, device=latents.device)
        pred = policy.predict(policy.add_noise(latents, noise, t), t, batch.prompt_embeds, 1.0)
        loss = self.weight * per_sample_mse(pred, policy.training_target(latents, noise, t)).mean()
        return loss, {"loss": loss.detach(), "dummy_weight": torch.tensor(self.weight)}


@pytest.fixture
def search_path(tmp_path):
    """A config folder holding the method's one YAML option, as a user's or a plugin's would."""
    folder = tmp_path / "configs"
    (folder / "method").mkdir(parents=True)
    (folder / "method" / "dummy_denoise.yaml").write_text(
        "defaults:\n  - /schema/method/dummy_denoise@_here_\n  - _self_\n\nweight: 2.0\n")
    return f"hydra.searchpath=[file://{folder}]"


def test_the_schema_registers_itself_from_its_own_file():
    assert discover()["method"]["dummy_denoise"] is DummyDenoiseConfig


def test_the_yaml_option_extends_the_self_registered_schema(search_path):
    method = compose_cfg([search_path, "method=dummy_denoise"]).method
    assert (method._target_, method.timestep, method.weight) == (f"{__name__}.DummyDenoise", 500, 2.0)
    with pytest.raises(ConfigCompositionException):  # overrides are type-checked against the dataclass
        compose_cfg([search_path, "method=dummy_denoise", "method.timestep=late"])


def test_the_preference_loop_trains_the_new_method(search_path, tmp_path):
    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    run = tmp_path / "run"
    overrides = [o for o in smoke_overrides(run, steps=2) if not o.startswith("data.")]
    cfg = compose_cfg([search_path, *overrides, "method=dummy_denoise", "data=shapes_winners", "data.num_samples=8"])
    validate_train_config(cfg)
    train(cfg)
    first, final = load_file(run / "checkpoint-1" / "pytorch_lora_weights.safetensors"), \
        load_file(run / "final" / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(first[k], final[k]) for k in first)  # the second update moved the LoRA
    results = json.loads((run / "results.json").read_text())
    assert results["global_step"] == 2 and results["history_tail"][-1]["dummy_weight"] == 2.0
    bad = compose_cfg([search_path, *overrides, "method=dummy_denoise", "method.timestep=1000",
                       f"output_dir={tmp_path / 'bad'}"])
    with pytest.raises(ValueError, match="method.timestep=1000"):  # its own check_config, before any model loads
        validate_train_config(bad)
