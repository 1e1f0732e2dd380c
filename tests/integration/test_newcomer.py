"""Newcomer friction (issue 32 item 6): the main job ends with its headline paired gain; an online run says what its
default evaluation costs and how to skip it; ``diffalign-bench --quick`` is one run per data flow with a small
evaluation; the report's training curves count epochs for an online run and draw the learning rate unsmoothed."""

from __future__ import annotations

import json
import math
import statistics

from conftest import ONLINE_CASES, compose_cfg, online_overrides, smoke_overrides
from hydra.utils import get_class
from omegaconf import OmegaConf

from diffalign.evaluation.bench import METHODS, main
from diffalign.evaluation.report import plot_training_curves, training_axis, training_figure
from diffalign.world.prompts import load_prompts

SMALL_EVAL = ["eval.enabled=true", "eval.prompts_per_tag=1", "eval.sampler.num_inference_steps=2",
              "eval.batch_size=16"]


def expected_headline(eval_dir) -> str:
    """The headline derived by hand: the accuracy of each variant from metrics.json, the paired gain and its standard
    error (sample s.d. / √n) from the per-image verdicts of samples.jsonl, paired by (prompt, seed)."""
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    verdicts = {}
    for line in (eval_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        verdicts[row["variant"], row["prompt_index"], row["seed"]] = float(row["geneval_shapes/correct"])
    pairs = sorted({(p, s) for _, p, s in verdicts})
    diffs = [verdicts["finetuned", p, s] - verdicts["base", p, s] for p, s in pairs]
    gain, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    start = metrics["variants"]["base"]["geneval_shapes/accuracy"]
    end = metrics["variants"]["finetuned"]["geneval_shapes/accuracy"]
    assert math.isclose(end - start, gain, abs_tol=1e-12)
    ratio = f"{gain / se:.1f} s.e.; " if se > 0 else ""
    seeds = len({s for _, s in pairs})
    return (f"[diffalign] headline: geneval_shapes accuracy {start:.3f} → {end:.3f}, paired gain {gain:+.3f} ± "
            f"{se:.3f} ({ratio}finetuned − base over {len(pairs) // seeds} prompts × {seeds} seeds)")


def test_the_main_job_ends_with_its_headline_paired_gain(tmp_path, capsys):
    from diffalign.train.preference import train

    # the shipped tiny SD model (its verifier accuracy is neither 0 nor 1) with the main job's reward and evaluation
    overrides = [o for o in smoke_overrides(tmp_path) if not o.startswith(("model=", "eval."))]
    train(compose_cfg([*overrides, "model=tiny_sd", "trainer.optimizer.lr=0.3", "eval.seeds=[0,1,2]", *SMALL_EVAL,
                       "eval.sampler.num_inference_steps=10"]))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == expected_headline(tmp_path / "eval")
    assert "± 0.000" not in lines[-1]  # some verdicts changed: the s.e. is not a trivial 0
    assert json.loads((tmp_path / "results.json").read_text())["headline"] == lines[-1]


def test_an_online_run_says_what_its_evaluation_costs_and_how_to_skip_it(tmp_path, capsys):
    from diffalign.train.online import train

    overrides = [o for o in online_overrides(tmp_path, epochs=1) if not o.startswith("eval.")]
    train(compose_cfg([*overrides, *ONLINE_CASES["flow_grpo_sd"], "eval.seeds=[0]", *SMALL_EVAL]))
    out = capsys.readouterr().out
    prompts = len({row.get("tag") for row in load_prompts("heldout")})  # one prompt per tag
    hint = [line for line in out.splitlines() if "the run ends with an evaluation" in line]
    assert len(hint) == 1 and f"on {prompts} prompts × 1 seeds = {2 * prompts} images at 2 sampler steps" in hint[0]
    assert "eval.enabled=false" in hint[0]
    assert out.index(hint[0]) < out.index("[diffalign] report:")  # said before the evaluation starts
    assert out.strip().splitlines()[-1].startswith("[diffalign] headline: geneval_shapes accuracy ")
    # eval.enabled=false: no hint
    skipped = [o for o in online_overrides(tmp_path / "skip", epochs=1)] + ONLINE_CASES["flow_grpo_sd"]
    train(compose_cfg(skipped))
    assert "the run ends with an evaluation" not in capsys.readouterr().out


def test_bench_quick_is_one_run_per_data_flow_with_a_small_evaluation(capsys):
    assert main(["--quick", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4  # was 21 (11 methods × 2 rewards, DDSPO on one)
    flows = []
    for line in lines:
        args = line.split("diffalign-train ", 1)[1].split()
        cfg = compose_cfg(args + ["output_dir=/tmp/unused"])
        flows.append(get_class(cfg.method._target_).data_flow)
        assert list(cfg.reward) == ["brightness"] and cfg.seed == 0
        assert cfg.eval.prompts_per_tag == 2 and list(cfg.eval.seeds) == [0, 1]
        assert cfg.eval.sampler.num_inference_steps == 10
        online = "online_" in flows[-1]
        assert (cfg.online.num_epochs, cfg.online.groups_per_epoch) == (3, 4) if online else cfg.trainer.max_steps == 10
    assert sorted(flows) == ["online_groups", "online_trajectories", "pairs", "winners"]
    # every method and both default rewards stay one option away, each with the quick settings
    main(["--quick", "--list", "--methods", *METHODS, "--rewards", "brightness", "verifier"])
    # one run per (method, reward), DDSPO on the verifier only
    assert len(capsys.readouterr().out.strip().splitlines()) == 2 * len(METHODS) - 1


def test_the_report_counts_epochs_for_an_online_run_and_draws_the_lr_unsmoothed(tmp_path):
    for name, overrides, axis in (("online", online_overrides(tmp_path) + ONLINE_CASES["ddpo_sd"], "epoch"),
                                  ("offline", smoke_overrides(tmp_path), "step")):
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        OmegaConf.save(compose_cfg(overrides), run / ".hydra" / "config.yaml")
        assert training_axis(run) == axis
    assert training_axis(tmp_path / "no-config") == "step"

    epochs = list(range(1, 31))
    lr = [min(1.0, e / 3) * 1e-3 for e in epochs]  # a warm-up of 3 epochs
    fig = training_figure("lr", epochs, lr, "epoch")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "epoch" and len(ax.lines) == 1  # no moving average on top
    assert list(ax.lines[0].get_ydata()) == lr  # reaches 1e-3 at epoch 3, as the schedule does
    noisy = training_figure("loss", epochs, [float(e % 3) for e in epochs], "epoch")
    assert len(noisy.axes[0].lines) == 2  # a noisy series keeps its EMA
    paths = plot_training_curves({"lr": list(zip(epochs, lr))}, tmp_path / "plots", x_label="epoch")
    assert [p.name for p in paths] == ["train_lr.png"] and paths[0].stat().st_size > 0
