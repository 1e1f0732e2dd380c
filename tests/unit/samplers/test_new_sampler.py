"""A new sampler is one file (its step function and its `Sampler` class) and one config, with no central edit: this
module is the file (the class registers itself with `register_sampler`), a YAML option written into a folder on Hydra's
search path is the config, and the online loop trains with it (Flow-GRPO on the tiny flow model), evaluation and the
monitors sample with it (``sampler@eval.sampler=...``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from conftest import compose_cfg, online_overrides
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file

from diffalign.config.checks import number
from diffalign.config.schemas import discover
from diffalign.samplers.base import FlowSampler, build_sampler, register_sampler, sampler_names
from diffalign.samplers.flow_sde import sample_and_score

CALLS: list[tuple[int, bool]] = []  # (step index, scored a given x_{k+1}) of every step taken


def euler_maruyama_step(model_output, sigma, sigma_next, sample, *, noise_level, generator=None, prev_sample=None,
                        reduction="mean"):
    """x_{k+1} = x_k + (σ_{k+1} − σ_k) v̂ + noise_level · sqrt(σ_k − σ_{k+1}) z: the Euler ODE step plus isotropic
    noise (it does not keep the flow's marginals; a test sampler)."""
    x, v = sample.float(), model_output.float()
    mean = x + (sigma_next - sigma) * v
    std = noise_level * torch.sqrt(torch.as_tensor(sigma - sigma_next, dtype=torch.float32))
    return sample_and_score(mean, std, generator, prev_sample, reduction)


@register_sampler
@dataclass
class EulerMaruyamaSampler(FlowSampler):
    """``sampler=euler_maruyama``: `euler_maruyama_step` with per-step log-probs."""

    name: str = "euler_maruyama"
    num_inference_steps: int = 4
    guidance_scale: float = 4.5
    noise_level: float = 0.5

    noise_field: ClassVar[str] = "noise_level"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        number(vars(self), "noise_level", "", gt=0, hint="the step noise; > 0 for log-probs")

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        CALLS.append((k, prev_sample is not None))
        sigmas = schedule.sigmas
        return euler_maruyama_step(model_output, sigmas[k], sigmas[k + 1], sample, noise_level=self.noise_level,
                                   generator=generator, prev_sample=prev_sample, reduction=reduction)


@pytest.fixture
def search_path(tmp_path):
    """A config folder holding the sampler's one YAML option, as a user's or a plugin's would."""
    folder = tmp_path / "configs"
    (folder / "sampler").mkdir(parents=True)
    (folder / "sampler" / "euler_maruyama.yaml").write_text(
        "defaults:\n  - /schema/sampler/euler_maruyama@_here_\n  - _self_\n\nnoise_level: 0.3\n")
    return f"hydra.searchpath=[file://{folder}]"


def test_the_sampler_registers_itself_from_its_own_file(search_path):
    assert discover()["sampler"]["euler_maruyama"] is EulerMaruyamaSampler and "euler_maruyama" in sampler_names()
    sampler = compose_cfg([search_path, "sampler=euler_maruyama"]).sampler
    assert (sampler.name, sampler.num_inference_steps, sampler.noise_level) == ("euler_maruyama", 4, 0.3)
    with pytest.raises(ConfigCompositionException):  # overrides are type-checked against the dataclass
        compose_cfg([search_path, "sampler=euler_maruyama", "sampler.noise_level=high"])
    with pytest.raises(ValueError, match=r"sampler.noise_level must be a number > 0, got 0"):  # its own check
        build_sampler(compose_cfg([search_path, "sampler=euler_maruyama", "sampler.noise_level=0"]).sampler)


def test_the_online_loop_trains_with_the_new_sampler(search_path, tmp_path):
    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    run = tmp_path / "run"
    cfg = compose_cfg([search_path, *online_overrides(run, epochs=2), "model=tiny_flow_random", "method=flow_grpo",
                       "sampler=euler_maruyama", "sampler.num_inference_steps=3", "method.timestep_fraction=1.0"])
    validate_train_config(cfg)
    CALLS.clear()
    train(cfg)
    sampled = [k for k, scored in CALLS if not scored]
    rescored = [k for k, scored in CALLS if scored]
    # 2 epochs x 8 rollouts in one chunk x 3 steps drawn; every transition re-scored by the Flow-GRPO loss
    assert sampled == [0, 1, 2] * 2 and sorted(set(rescored)) == [0, 1, 2]
    first, final = (load_file(run / d / "pytorch_lora_weights.safetensors") for d in ("checkpoint-1", "final"))
    assert any(not torch.equal(first[k], final[k]) for k in first)  # the second epoch's update moved the LoRA
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(abs(h["ratio"] - 1) < 1e-2 for h in history)  # stored log-probs reproduced


def test_evaluation_and_the_monitors_sample_with_the_new_sampler(search_path):
    """``sampler@eval.sampler=euler_maruyama`` / ``sampler@monitor.sampler=...`` select the new option for evaluation
    and the monitors, field overrides apply, and its step function draws their images."""
    from hydra.utils import instantiate

    from diffalign.config.validation import validate_eval_config
    from diffalign.evaluation.generation import eval_config_from, image_seed, sample_images
    from diffalign.evaluation.monitors import build_monitor

    cfg = compose_cfg([search_path, "model=tiny_flow_random", "sampler@eval.sampler=euler_maruyama",
                       "eval.sampler.num_inference_steps=2", "eval.sampler.noise_level=0.4"], name="evaluate")
    validate_eval_config(cfg)  # (the sampler fits the flow model)
    ecfg = eval_config_from(cfg.eval)
    assert ecfg.sampler == EulerMaruyamaSampler(num_inference_steps=2, noise_level=0.4)
    policy = instantiate(cfg.model)
    rows, jobs = [{"prompt": "a red circle"}], [(0, 0), (0, 1)]
    CALLS.clear()
    images = sample_images(policy, jobs, rows, ecfg, use_reference=False)
    assert CALLS == [(0, False), (1, False)]  # one batch of 2 steps, drawn by its `step`
    gens = [torch.Generator().manual_seed(image_seed(s, p)) for p, s in jobs]
    by_hand = EulerMaruyamaSampler(num_inference_steps=2, noise_level=0.4).sample(
        policy, ["a red circle"] * 2, generator=gens).images
    torch.testing.assert_close(images, by_hand.float().cpu(), rtol=0, atol=0)
    # the monitor's node: the same option through the train config's defaults list
    train_cfg = compose_cfg([search_path, "model=tiny_flow_random", "monitor.every=1", "monitor.diversity=false",
                             "sampler@monitor.sampler=euler_maruyama", "monitor.sampler.num_inference_steps=3"])
    monitor = build_monitor(train_cfg.monitor, {"brightness": lambda *a: None})
    assert monitor.sampler == EulerMaruyamaSampler(num_inference_steps=3, noise_level=0.3)
