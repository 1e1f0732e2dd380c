"""The online loop (DGPO, Flow-GRPO, DDPO): short runs on tiny random models, exact resume, up-front errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ONLINE_CASES as CASES
from conftest import compose_cfg, online_overrides
from safetensors.torch import load_file

from diffalign.config.validation import validate_train_config
from diffalign.train.online import train


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_online_method_runs_on_both_families_and_updates_the_lora(case, tmp_path):
    cfg = compose_cfg(CASES[case] + online_overrides(tmp_path))
    validate_train_config(cfg)
    results = train(cfg)
    assert results["epochs"] == 2 and results["rollouts"] == 16
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert "advantage/zero_std_fraction" in history[0] and "reward/geneval_shapes/mean" in history[0]
    lora = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k or "lora.up" in k)


def test_resume_continues_exactly(tmp_path):
    base = CASES["dgpo_flow"]
    full = train(compose_cfg(base + online_overrides(tmp_path / "full", epochs=3)))
    train(compose_cfg(base + online_overrides(tmp_path / "part", epochs=2)))
    resumed = train(compose_cfg(base + online_overrides(tmp_path / "part", epochs=3) + ["resume=latest"]))
    assert resumed["global_step"] == full["global_step"]
    a = load_file(tmp_path / "full" / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "part" / "final" / "pytorch_lora_weights.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    ha = (tmp_path / "full" / "history.jsonl").read_text().splitlines()[-1]
    hb = (tmp_path / "part" / "history.jsonl").read_text().splitlines()[-1]
    assert json.loads(ha)["loss"] == json.loads(hb)["loss"]
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "part" / "history.jsonl").read_text().splitlines()]
    assert epochs == [1, 2, 3]  # the resumed run keeps the log of the epochs before its checkpoint


@pytest.mark.parametrize("overrides,match", [
    (["method=ddpo", "sampler=dpm_ode"], "policy-gradient method"),
    (["method=flow_grpo", "sampler=ddim", "sampler.eta=0"], "policy-gradient method"),
    (["method=dgpo", "sampler=dpm_ode", "online.group_size=1"], "online.group_size"),
    (["method=dgpo", "sampler=dpm_ode", "sampler.num_inference_steps=4"], "method.timestep_max_index"),
    (["method=dgpo", "sampler=dpm_ode", "trainer.batch_size=12", "online.group_size=8"], "trainer.batch_size"),
    (["method=dgpo", "sampler=dpm_ode", "online.prompts=/nonexistent.jsonl"], "online.prompts"),
    (["recipe=dgpo_sd35_geneval"], "online.prompts is required"),
    (["method=dgpo"], "deterministic ODE solver"),
    (["method=dgpo", "sampler=dpm_ode", "online.advantage_std_correction=2"], "online.advantage_std_correction"),
    (["method=dgpo", "sampler=dpm_ode", "online.advantage_eps=0"], "online.advantage_eps"),
])
def test_bad_online_configs_fail_before_any_model_loads(overrides, match, tmp_path):
    cfg = compose_cfg(["model=tiny_random", f"output_dir={tmp_path}"] + overrides)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        validate_train_config(cfg)


def test_monitor_logs_held_out_accuracy_before_and_during_training(tmp_path):
    cfg = compose_cfg(CASES["dgpo_sd"] + online_overrides(tmp_path) + [
        "monitor.every=1", "monitor.num_prompts=2", "monitor.seeds=[0,1]", "monitor.diversity=false",
        "monitor.sampler.num_inference_steps=2"])
    train(cfg)
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    key = "monitor/gold/geneval_shapes/accuracy"
    assert [h["epoch"] for h in history] == [0, 1, 2] and all(key in h for h in history)
    assert history[0]["rollouts"] == 0 and history[-1]["rollouts"] == 16
    assert history[-1]["train_seconds"] > 0
    for h in history:  # one PNG per monitor prompt and measurement
        assert sorted(f.name for f in (tmp_path / "logs" / "samples" / f"step-{h['step']}").iterdir()) == \
            ["000.png", "001.png", "prompts.txt"]


def test_flow_grpo_trains_the_first_transitions_in_order_as_released():
    from hydra.utils import instantiate

    from diffalign.objectives.policy_gradient import train_transitions

    # flow_grpo scripts/train_sd3.py: num_train_timesteps = int(num_steps * timestep_fraction), then
    # `for j in range(num_train_timesteps)` over the time-ordered stored transitions
    assert train_transitions(10, 0.99, "first") == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # int(9.9) = 9: never the 10th
    assert train_transitions(16, 0.6, "first") == [0, 1, 2, 3, 4, 5, 6, 7, 8]  # int(9.6) = 9
    assert train_transitions(40, 0.5, "first") == list(range(20))
    assert train_transitions(3, 0.1, "first") == [0]  # int(0.3) = 0 trains nothing there; at least one here
    # ddpo-pytorch (timestep_fraction 1.0, config/base.py) trains every transition of every sample: so does "random"
    assert train_transitions(50, 1.0, "random", torch.Generator().manual_seed(0)) == list(range(50))
    # "random": the former loop's draw (5 distinct of 10, increasing), so runs and resumes are unchanged
    picked = train_transitions(10, 0.5, "random", torch.Generator().manual_seed(3))
    assert picked == torch.randperm(10, generator=torch.Generator().manual_seed(3))[:5].sort().values.tolist()
    assert len(set(picked)) == 5 and picked == sorted(picked)
    with pytest.raises(ValueError, match="method.timestep_selection"):
        train_transitions(10, 0.5, "per_sample")
    # defaults: Flow-GRPO "first" (class, method config, paper recipe); DDPO and ViPO "random"
    for overrides, expected in [(["method=flow_grpo"], "first"), (["recipe=flow_grpo_sd35_geneval"], "first"),
                                (["recipe=tiny_flow_grpo"], "first"), (["method=ddpo"], "random"),
                                (["recipe=ddpo_sd15_aesthetic"], "random"), (["method=vipo"], "random"),
                                (["recipe=vipo_wan"], "random")]:
        cfg = compose_cfg(overrides)
        assert cfg.method.timestep_selection == expected, overrides
        if "method=vipo" not in overrides and "recipe=vipo_wan" not in overrides:
            assert instantiate(cfg.method).timestep_selection == expected
    from diffalign.objectives.ddpo import DDPO
    from diffalign.objectives.flow_grpo import FlowGRPO
    from diffalign.objectives.vipo import ViPO

    for method in (FlowGRPO, DDPO, ViPO):
        with pytest.raises(ValueError, match="method.timestep_selection"):
            method(timestep_selection="last")


def test_the_online_loop_trains_flow_grpos_first_transitions(tmp_path, monkeypatch):
    from diffalign.objectives.flow_grpo import FlowGRPO

    trained = []
    call = FlowGRPO.__call__

    def spy(self, policy, trajectory, advantages, k, **kwargs):
        trained.append(k)
        return call(self, policy, trajectory, advantages, k, **kwargs)

    monkeypatch.setattr(FlowGRPO, "__call__", spy)
    cfg = compose_cfg(CASES["flow_grpo_flow"] + online_overrides(tmp_path, epochs=1) + ["trainer.batch_size=4"])
    train(cfg)
    # 4 rollout steps, timestep_fraction 0.99: int(3.96) = 3 transitions, 0, 1, 2 in order, for each of 2 minibatches
    assert trained == [0, 1, 2, 0, 1, 2]
