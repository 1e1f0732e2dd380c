"""Reward failures stop a run cleanly: a checkpoint is saved first, and the error names the reward, the step, the
batch and the prompt. Nothing is replaced by zero. Also the hacking monitors and multi-reward weighting."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg

from diffalign.config import registry
from diffalign.config.validation import validate_train_config
from diffalign.evaluation.monitors import HackingMonitor, build_monitor, pairwise_diversity
from diffalign.rewards import python_function, reward_set
from diffalign.rewards.base import RewardError
from diffalign.rewards.compressibility import JpegCompressibility
from diffalign.rewards.reward_set import (
    CheckedReward,
    WeightedSum,
    reward_metrics,
    score_or_raise,
    stop_on_reward_error,
    zscore,
)
from diffalign.runtime.checkpoint import latest_checkpoint, load_checkpoint
from diffalign.types import RewardOutput

CALLS = {"n": 0}


def nan_on_second_row(images, prompts, metadata=None):
    """A broken reward: NaN for the second image of every batch."""
    scores = images.flatten(1).mean(1).float().clone()
    scores[1] = float("nan")
    return scores


def raises_always(images, prompts, metadata=None):
    """A broken reward: its scorer raises."""
    raise RuntimeError("the scorer is broken")


def nan_from_third_call(images, prompts, metadata=None):
    """Fine twice (the monitor's baseline and step 1), NaN from the third call on (step 2)."""
    CALLS["n"] += 1
    scores = images.flatten(1).mean(1).float().clone()
    if CALLS["n"] >= 3:
        scores[:] = float("nan")
    return RewardOutput(scores)


class NanReward:
    """`nan_on_second_row` as a reward class."""

    differentiable = False
    name = "nan"

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(nan_on_second_row(images, prompts))


def base_overrides(tmp_path) -> list[str]:
    return [f"output_dir={tmp_path}", "model=tiny_random", "trainer.max_steps=2", "trainer.batch_size=2",
            "trainer.checkpointing_steps=1", "trainer.keep_last=-1", "trainer.log_with=none", "eval.enabled=false",
            "trainer.lr_warmup_steps=1"]


def assert_loadable(cfg, ckpt, step: int):
    """The checkpoint loads like ``resume=latest`` does: optimizer, LR scheduler, trainer state, LoRA."""
    from hydra.utils import instantiate

    from diffalign.lora.initial import model_config
    from diffalign.train.preference import build_lr_scheduler

    policy = instantiate(model_config(cfg.model))
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    state = load_checkpoint(ckpt, optimizer=optimizer, lr_scheduler=build_lr_scheduler(optimizer, 1, 2, "cosine"))
    assert state["global_step"] == step
    policy.load_lora_weights(ckpt)  # the diffusers LoRA file loads back


def test_nan_reward_stops_a_two_step_run_with_a_loadable_checkpoint(tmp_path):
    """data=ranked_pairs calls the reward while preparing the run's data: the NaN stops it with checkpoint-0."""
    spec = "python:test_reward_failures:nan_on_second_row"
    registry.register_configs()
    assert python_function.register_python_reward(spec) == "nan_on_second_row"
    cfg = compose_cfg(base_overrides(tmp_path) + [
        f"reward=[{spec}]", "data=ranked_pairs", "data.num_prompts=2", "data.samples_per_prompt=2",
        "data.sampler.num_inference_steps=2", "data.batch_size=4", "data.reward=nan_on_second_row"])
    assert cfg.reward.nan_on_second_row.function == "test_reward_failures:nan_on_second_row"
    validate_train_config(cfg)
    from diffalign.train.preference import train

    with pytest.raises(RewardError, match=r"reward 'nan_on_second_row': returned non-finite scores") as info:
        train(cfg)
    err = info.value
    assert err.reward_name == "nan_on_second_row" and err.step == 0 and err.batch_index == 0
    assert "batch 0" in str(err) and "prompt '" in str(err) and err.prompts and err.prompts[0] in str(err)
    assert err.checkpoint == tmp_path / "checkpoint-0" == latest_checkpoint(tmp_path)
    assert_loadable(cfg, err.checkpoint, 0)
    assert not (tmp_path / "checkpoint-1").exists()


def test_nan_gold_reward_stops_mid_run_after_saving_that_step(tmp_path):
    """The hacking monitor's gold reward turns NaN at step 2 of 2: checkpoint-2 is written, then the run stops."""
    CALLS["n"] = 0
    spec = "python:test_reward_failures:nan_from_third_call"
    registry.register_configs()
    python_function.register_python_reward(spec)
    cfg = compose_cfg(base_overrides(tmp_path) + [
        f"eval_reward=[{spec}]", "data=shapes_pairs", "data.num_pairs=8", "monitor.every=1", "monitor.num_prompts=2",
        "monitor.seeds=[0,1]", "monitor.sampler.num_inference_steps=2"])
    validate_train_config(cfg)
    from diffalign.train.preference import train

    with pytest.raises(RewardError, match=r"'nan_from_third_call'.*non-finite.*step 2.*batch 2") as info:
        train(cfg)
    assert info.value.checkpoint == tmp_path / "checkpoint-2" == latest_checkpoint(tmp_path)
    assert_loadable(cfg, info.value.checkpoint, 2)


@pytest.mark.parametrize("which", ["reward", "eval_reward"])
def test_online_loop_guards_its_training_and_evaluation_rewards(which, tmp_path):
    """One reward path in both loops: a NaN training reward stops the online run at its first scoring (step 0) with
    checkpoint-0; a NaN evaluation reward stops it in the final evaluation, after the run's last checkpoint."""
    from conftest import online_overrides

    from diffalign.train.online import train

    spec = "python:test_reward_failures:nan_on_second_row"
    registry.register_configs()
    python_function.register_python_reward(spec)
    evaluation = ["eval.enabled=true", "eval.prompts_per_tag=1", "eval.seeds=[0,1]",
                  "eval.sampler.num_inference_steps=2"]
    cfg = compose_cfg(online_overrides(tmp_path, epochs=1) + ["model=tiny_random", "method=flow_grpo",
                                                              "sampler=ddim", f"{which}=[{spec}]", *evaluation])
    with pytest.raises(RewardError, match=r"reward 'nan_on_second_row': returned non-finite scores") as info:
        train(cfg)
    step = 0 if which == "reward" else 1
    assert info.value.step == step and info.value.checkpoint == tmp_path / f"checkpoint-{step}"
    assert latest_checkpoint(tmp_path) == tmp_path / f"checkpoint-{step}"


def test_the_weighted_sum_guards_its_components_with_the_step_set_by_the_loop():
    """Build → guard → combine: every component of `build_rewards` is a `CheckedReward`; an unguarded component
    given to `WeightedSum` is wrapped; the failure names the step the loop set (`set_reward_step`)."""
    from diffalign.rewards.reward_set import set_reward_step

    combined = WeightedSum({"ok": JpegCompressibility(), "nan": NanReward()}, {"ok": 1.0, "nan": 2.0})
    assert all(isinstance(r, CheckedReward) for r in combined.rewards.values())
    assert isinstance(reward_set.build_rewards({"jpeg_compressibility": {}}).rewards["jpeg_compressibility"],
                      CheckedReward)
    set_reward_step(combined, 4)
    with pytest.raises(RewardError, match=r"reward 'nan'.*step 4; batch 0; prompt 'b'"):
        combined(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_score_or_raise_names_reward_step_batch_and_prompt():
    images = torch.rand(3, 3, 8, 8)
    prompts = ["p0", "p1", "p2"]

    def raising(images, prompts, metadata=None):
        raise RuntimeError("server down")

    with pytest.raises(RewardError, match=r"reward 'srv': raised RuntimeError: server down \(step 7; batch 3; "
                                          r"prompts 'p0', 'p1', 'p2'\)"):
        score_or_raise({"srv": raising}, images, prompts, step=7, batch_index=3)
    with pytest.raises(RewardError, match=r"reward 'short': returned scores of shape \(2,\)"):
        score_or_raise({"short": lambda i, p, m: RewardOutput(torch.zeros(2))}, images, prompts)
    combined = WeightedSum({"ok": JpegCompressibility(), "bad": NanReward()}, {"ok": 1.0, "bad": 1.0})
    with pytest.raises(RewardError, match=r"reward 'bad'.*step 1; batch 0") as info:
        score_or_raise({"total": combined}, images, prompts, step=1, batch_index=0)
    assert info.value.reward_name == "bad"
    checked = CheckedReward("nan", NanReward())
    checked.step = 5
    for batch in range(2):
        with pytest.raises(RewardError, match=rf"step 5; batch {batch}; prompt 'p1'"):
            checked(images, prompts)


def test_stop_on_reward_error_saves_then_reraises_without_printing(tmp_path, capsys):
    saved = []
    with pytest.raises(RewardError) as info, stop_on_reward_error(lambda: saved.append(1) or tmp_path):
        raise RewardError("r", "returned non-finite scores", step=3)
    assert saved == [1] and info.value.checkpoint == tmp_path
    assert str(info.value) == (f"reward 'r': returned non-finite scores — checkpoint saved to {tmp_path}; fix or "
                               f"deselect the reward, then continue with output_dir={tmp_path.parent} resume=latest "
                               "(step 3)")  # (the folder holding the checkpoint: the run's)
    assert capsys.readouterr() == ("", "")  # the raised message is the one report (the CLI's exit line)
    with stop_on_reward_error(lambda: saved.append(2)):
        pass
    assert saved == [1]  # nothing saved without an error


def test_a_failing_reward_is_reported_once_by_the_cli(tmp_path, capsys, caplog, release_run_locks):
    """``diffalign-train`` with a reward that raises: the failure's message appears once, as the exit line (the loop
    said it a second time, "[diffalign] stopping: ..."); the reward's traceback is logged once, for its author."""
    from diffalign.cli import _train_main

    spec = "python:test_reward_failures:raises_always"
    registry.register_configs()
    python_function.register_python_reward(spec)
    cfg = compose_cfg(base_overrides(tmp_path) + [
        f"reward=[{spec}]", "data=ranked_pairs", "data.num_prompts=2", "data.samples_per_prompt=2",
        "data.sampler.num_inference_steps=2", "data.batch_size=4", "data.reward=raises_always"])
    with pytest.raises(SystemExit) as info:
        _train_main(cfg)
    line = str(info.value.code)
    assert line.startswith("diffalign: error: reward 'raises_always': raised RuntimeError: the scorer is broken — "
                           f"checkpoint saved to {tmp_path / 'checkpoint-0'}; fix or deselect"), line
    out, err = capsys.readouterr()
    said = out + err + "\n".join(r.getMessage() for r in caplog.records)
    assert said.count("checkpoint saved to") == 0 and said.count("fix or deselect") == 0, said
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "reward 'raises_always' raised at step 0, batch 0"]  # (with the traceback)


# ------------------------------------------------------------------------------------------- weighting


def test_weights_and_normalisation_from_the_command_line():
    cfg = compose_cfg(["reward=[jpeg_compressibility,jpeg_incompressibility]",
                         "reward.jpeg_compressibility.weight=0.5", "reward.jpeg_incompressibility.normalize=zscore",
                         "eval_reward=[geneval_shapes]"])
    assert cfg.reward.jpeg_compressibility.weight == 0.5 and cfg.reward.jpeg_incompressibility.weight == 1.0
    assert list(cfg.eval_reward) == ["geneval_shapes"] and compose_cfg([]).get("eval_reward") is None
    combined = reward_set.build_rewards(cfg.reward)
    images = torch.rand(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    out = combined(images, ["a"] * 4)
    comp, incomp = JpegCompressibility()(images, ["a"] * 4).scores, out.info["scores/jpeg_incompressibility"]
    torch.testing.assert_close(out.scores, 0.5 * comp + zscore(incomp))
    torch.testing.assert_close(out.info["normalized/jpeg_incompressibility"], zscore(incomp))
    metrics = reward_metrics(out)
    assert set(metrics) == {"reward/mean", "reward/std", "reward/jpeg_compressibility/mean",
                            "reward/jpeg_compressibility/std", "reward/jpeg_incompressibility/mean",
                            "reward/jpeg_incompressibility/std"}
    with pytest.raises(ValueError, match="normalize='rank'"):
        reward_set.build_rewards({"jpeg_compressibility": {"normalize": "rank"}})


def test_zscore_of_a_constant_or_single_batch_is_zero():
    torch.testing.assert_close(zscore(torch.tensor([0.7, 0.7, 0.7])), torch.zeros(3))
    torch.testing.assert_close(zscore(torch.tensor([3.0])), torch.zeros(1))
    torch.testing.assert_close(zscore(torch.tensor([1.0, 3.0])), torch.tensor([-1.0, 1.0]), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------- monitors


def test_pairwise_diversity_by_hand():
    same = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0]])
    assert pairwise_diversity(same).item() == pytest.approx(0.0, abs=1e-6)
    orthogonal = torch.eye(3)
    assert pairwise_diversity(orthogonal).item() == pytest.approx(1.0, abs=1e-6)
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    assert pairwise_diversity(opposite).item() == pytest.approx(2.0, abs=1e-6)
    with pytest.raises(ValueError, match="G >= 2"):
        pairwise_diversity(torch.ones(1, 4))


def test_monitor_logs_every_n_steps_and_is_deterministic(tiny_policy):
    from diffalign.rewards.clip_score import ClipScore
    from diffalign.rewards.geneval_shapes import GenevalShapes

    rows = [{"prompt": "a red circle"}, {"prompt": "two blue squares"}]
    monitor = HackingMonitor({"geneval_shapes": GenevalShapes()}, rows, [0, 1, 2], every=2, embedder=ClipScore(),
                             sampler={"name": "ode", "num_inference_steps": 2})
    logged = []

    class Tracker:
        def log(self, metrics, step):
            logged.append((step, metrics))

    assert monitor.maybe_log(1, tiny_policy, Tracker()) is None
    first = monitor.maybe_log(2, tiny_policy, Tracker())
    second = monitor.maybe_log(4, tiny_policy, Tracker())
    assert set(first) == {"monitor/gold/geneval_shapes/mean", "monitor/gold/geneval_shapes/accuracy",
                          "monitor/diversity"}
    assert first == second  # fixed prompts and seeds, same policy → same numbers
    assert [s for s, _ in logged] == [2, 4] and 0.0 <= first["monitor/diversity"] <= 2.0
    assert tiny_policy.unet.training is False or tiny_policy.unet.training is True  # mode restored, not forced


def test_build_monitor_from_config_and_bad_fields():
    from diffalign.rewards.geneval_shapes import GenevalShapes

    assert build_monitor({"every": 0}, {}) is None and build_monitor(None, {}) is None
    monitor = build_monitor({"every": 5, "num_prompts": 3, "seeds": [0, 1], "diversity": False},
                            {"geneval_shapes": GenevalShapes()})
    assert monitor.every == 5 and len(monitor.rows) == 3 and monitor.embedder is None
    with pytest.raises(ValueError, match="not in the evaluation reward set"):
        build_monitor({"every": 1, "rewards": ["pickscore"]}, {"geneval_shapes": GenevalShapes()})
    with pytest.raises(TypeError):
        build_monitor({"every": 1, "evry": 2}, {})
    cfg = compose_cfg(["monitor.every=10", "monitor.seeds=[0]"])
    with pytest.raises(ValueError, match="monitor.seeds"):
        validate_train_config(cfg)
