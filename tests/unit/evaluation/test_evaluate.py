"""Evaluation: identical seeds across checkpoints, win rates, per-tag accuracy, bootstrap intervals, prompt formats,
checkpoint lists, resuming, and video export (tiny random model, a few prompts, 1-2 sampler steps)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import compose_cfg, perturb_lora_
from PIL import Image

import diffalign.evaluation.evaluate as evaluate_module
import diffalign.evaluation.generation as generation_module
from diffalign.evaluation.evaluate import evaluate_policy
from diffalign.evaluation.files import checkpoint_step, resolve_checkpoints
from diffalign.evaluation.generation import EvalConfig
from diffalign.evaluation.scoring import compare, summarize
from diffalign.evaluation.stats import bootstrap_ci, paired_wins
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.runtime.media import save_video
from diffalign.types import RewardOutput
from diffalign.world.prompts import load_prompts


class KnownOutcomes:
    """A verifier whose outcome per prompt is written in the prompt row (``"outcome": true/false``); score = outcome,
    plus the image mean so that scores differ between images."""

    def __init__(self, fail_on_call: int | None = None):
        self.calls = 0
        self.fail_on_call = fail_on_call

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise KeyboardInterrupt("simulated interruption")
        correct = torch.tensor([bool(m["outcome"]) for m in metadata])
        return RewardOutput(scores=correct.float(), info={"correct": correct})


class ImageMean:
    def __call__(self, images, prompts, metadata):
        return RewardOutput(scores=images.float().flatten(1).mean(1))


def _lora_dir(tmp_path, name: str, seed: int):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy, seed=seed)
    policy.save_lora_weights(tmp_path / name)
    return tmp_path / name


def _rows(n: int = 3) -> list[dict]:
    return [{"prompt": p, "tag": t, "outcome": o} for p, t, o in
            [("a red circle", "colors", True), ("two squares", "counting", False), ("a blue triangle", "colors", False),
             ("a circle and a square", "two_object", True)][:n]]


def test_two_identical_checkpoints_give_identical_images_and_a_win_rate_of_one_half(tmp_path):
    a = _lora_dir(tmp_path, "a", seed=1)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    policy = build_tiny_random_policy(seed=0)
    cfg = EvalConfig(seeds=[0, 1], sampler={"name": "ode", "num_inference_steps": 2}, batch_size=3)
    metrics = evaluate_policy(policy, _rows(3), {"mean": ImageMean()}, cfg, tmp_path / "ev",
                              {"base": True, "a": a, "b": b}, progress=False)
    samples = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    by = {(s["variant"], s["prompt_index"], s["seed"]): s for s in samples}
    for p in range(3):
        for s in (0, 1):
            img_a = np.asarray(Image.open(tmp_path / "ev" / by["a", p, s]["image"]))
            img_b = np.asarray(Image.open(tmp_path / "ev" / by["b", p, s]["image"]))
            img_base = np.asarray(Image.open(tmp_path / "ev" / by["base", p, s]["image"]))
            assert np.array_equal(img_a, img_b)
            assert not np.array_equal(img_a, img_base)  # the LoRA does something
            assert by["a", p, s]["mean"] == by["b", p, s]["mean"]
            assert by["a", p, s]["image_seed"] == by["base", p, s]["image_seed"] == s * 1_000_003 + p
    assert metrics["a_vs_base"]["mean/win_rate"]["win_rate"] == metrics["b_vs_base"]["mean/win_rate"]["win_rate"]
    # b against a directly: every pair is a tie, and a tie counts 0.5
    scores_a = [by["a", p, s]["mean"] for s in (0, 1) for p in range(3)]
    scores_b = [by["b", p, s]["mean"] for s in (0, 1) for p in range(3)]
    wins = paired_wins(scores_b, scores_a)
    assert wins.mean() == 0.5 and set(wins) == {0.5}
    same = compare({"mean": {"scores": scores_a}}, {"mean": {"scores": scores_b}}, "a", "b",
                                   groups=[0, 1, 2, 0, 1, 2])
    assert same["mean/win_rate"]["win_rate"] == 0.5 and same["mean/win_rate"]["ties"] == 6
    assert same["mean/win_rate"]["ci"] == [0.5, 0.5]
    # the per-prompt grid has a row per checkpoint and a column per seed, and metrics.csv has the win rates
    assert len(metrics["grids"]) == 3 and (tmp_path / "ev" / metrics["grids"][0]["path"]).is_file()
    assert "a,mean/win_rate" in (tmp_path / "ev" / "metrics.csv").read_text()


def test_win_rate_counts_wins_ties_and_losses():
    assert paired_wins([2.0, 1.0, 0.0, 5.0], [1.0, 1.0, 1.0, 5.0]).tolist() == [1.0, 0.5, 0.0, 0.5]
    with pytest.raises(ValueError, match="same pairs"):
        paired_wins([1.0], [1.0, 2.0])


def test_compare_gives_the_dense_score_gain_beside_the_accuracy_gain():
    # by hand: score differences +0.5, 0, -0.25, +0.75 -> mean 0.25 (s.e. from their sample variance); correctness
    # differences +1, 0, 0, +1 -> mean 0.5, std sqrt(1/3), s.e. sqrt(1/3)/2
    a = {"v": {"scores": [0.5, 0.5, 0.75, 0.25], "correct": [False, True, True, False]}}
    b = {"v": {"scores": [1.0, 0.5, 0.5, 1.0], "correct": [True, True, True, True]}}
    out = compare(a, b, "base", "ft")
    diffs = [0.5, 0.0, -0.25, 0.75]
    var = sum((d - 0.25) ** 2 for d in diffs) / 3
    assert out["v/mean_gain"]["gain"] == pytest.approx(0.25)
    assert out["v/mean_gain"]["se"] == pytest.approx((var / 4) ** 0.5)
    assert out["v/accuracy_gain"]["gain"] == pytest.approx(0.5)
    assert out["v/accuracy_gain"]["se"] == pytest.approx((1 / 3 / 4) ** 0.5)
    assert next(iter(out)) == "v/accuracy_gain"  # the headline takes accuracy first
    # a reward without correctness has the score's gain only
    assert set(compare({"r": {"scores": [1.0, 2.0]}}, {"r": {"scores": [2.0, 2.0]}}, "a", "b")) == {
        "r/mean_gain", "r/win_rate"}


def test_per_tag_breakdown_of_a_geneval_file_is_exact(tmp_path):
    rows = [
        {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}], "prompt": "a red circle",
         "outcome": True},
        {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}], "prompt": "a blue square",
         "outcome": False},
        {"tag": "colors", "include": [{"class": "triangle", "count": 1, "color": "green"}],
         "prompt": "a green triangle", "outcome": True},
        {"tag": "counting", "include": [{"class": "circle", "count": 2}], "prompt": "two circles", "outcome": False},
        {"tag": "position", "include": [{"class": "square", "count": 1},
                                        {"class": "circle", "count": 1, "position": ["left of", 0]}],
         "prompt": "a circle left of a square", "outcome": True},
        {"tag": "position", "include": [{"class": "circle", "count": 1},
                                        {"class": "square", "count": 1, "position": ["above", 0]}],
         "prompt": "a square above a circle", "outcome": True},
    ]
    path = tmp_path / "metadata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_prompts(str(path))
    assert loaded == rows  # GenEval metadata rows are kept whole
    policy = build_tiny_random_policy(seed=0)
    cfg = EvalConfig(prompts=str(path), seeds=[0, 1, 2], sampler={"name": "ode", "num_inference_steps": 1},
                     batch_size=18)
    metrics = evaluate_policy(policy, loaded, {"verifier": KnownOutcomes()}, cfg, tmp_path / "ev", {"base": True},
                              progress=False)
    v = metrics["variants"]["base"]
    assert v["verifier/accuracy/colors"]["accuracy"] == 2 / 3 and v["verifier/accuracy/colors"]["n"] == 9
    assert v["verifier/accuracy/counting"]["accuracy"] == 0.0 and v["verifier/accuracy/counting"]["n"] == 3
    assert v["verifier/accuracy/position"]["accuracy"] == 1.0 and v["verifier/accuracy/position"]["n"] == 6
    assert v["verifier/accuracy"] == 12 / 18
    assert v["verifier/accuracy_tag_mean"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert [k.rsplit("/", 1)[1] for k in v if k.startswith("verifier/accuracy/")] == ["colors", "counting",
                                                                                            "position"]
    csv_text = (tmp_path / "ev" / "metrics.csv").read_text()
    assert "base,verifier/accuracy,counting,0.0,0.0,0.0,0.0,3" in csv_text


def test_bootstrap_intervals_are_reproducible_and_contain_the_mean():
    rng = np.random.default_rng(3)
    values = rng.normal(size=60)
    groups = np.repeat(np.arange(20), 3)
    a = bootstrap_ci(values, groups, num_resamples=500, seed=7)
    assert a == bootstrap_ci(values, groups, num_resamples=500, seed=7)
    assert a != bootstrap_ci(values, groups, num_resamples=500, seed=8)
    assert a[0] < values.mean() < a[1]
    wide = bootstrap_ci(values, groups, num_resamples=500, seed=7, confidence=0.99)
    assert wide[0] <= a[0] and a[1] <= wide[1]
    assert bootstrap_ci([0.25, 0.75], [0, 0]) == (0.5, 0.5)  # one prompt: nothing to resample
    summary = summarize({"r": {"scores": values.tolist()}}, [{"prompt_index": int(g)} for g in groups], seed=7,
                        num_resamples=500)
    assert summary["r/mean_ci"] == list(a)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_ci(values, groups, confidence=1.0)


def test_prompt_files_text_jsonl_drawbench_csv_and_partiprompts_tsv(tmp_path):
    (tmp_path / "p.txt").write_text("a red circle\n\ntwo squares\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a red circle", "seed_hint": 1}\n')
    (tmp_path / "drawbench.csv").write_text('Prompts,Category\n"A red colored car, parked.",Colors\nA cat.,Simple\n')
    (tmp_path / "parti.tsv").write_text("Prompt\tCategory\tChallenge\tNote\nbanana\tProduce & Plants\tBasic\t\n")
    assert load_prompts(str(tmp_path / "p.txt")) == [{"prompt": "a red circle"}, {"prompt": "two squares"}]
    assert load_prompts(str(tmp_path / "p.jsonl")) == [{"prompt": "a red circle", "seed_hint": 1}]
    assert load_prompts(str(tmp_path / "drawbench.csv")) == [{"prompt": "A red colored car, parked.", "tag": "Colors"},
                                                             {"prompt": "A cat.", "tag": "Simple"}]
    assert load_prompts(str(tmp_path / "parti.tsv")) == [{"prompt": "banana", "tag": "Produce & Plants",
                                                          "challenge": "Basic", "note": ""}]
    (tmp_path / "bad.csv").write_text("caption,x\nhello,1\n")
    with pytest.raises(ValueError, match="no prompt column"):
        load_prompts(str(tmp_path / "bad.csv"), field="eval.prompts")
    # categories give a per-tag breakdown of any reward's mean
    summary = summarize({"r": {"scores": [1.0, 3.0, 5.0]}}, [{"tag": "Colors", "prompt_index": 0},
                                                            {"tag": "Colors", "prompt_index": 1},
                                                            {"tag": "Simple", "prompt_index": 2}])
    assert summary["r/mean/Colors"] == {"mean": 2.0, "se": 1.0, "n": 2}
    assert summary["r/mean/Simple"]["mean"] == 5.0


def test_checkpoint_lists_expand_run_folders_in_step_order(tmp_path):
    run = tmp_path / "my-run"
    for name in ("checkpoint-10", "checkpoint-2", "final"):
        (run / name).mkdir(parents=True)
        (run / name / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (run / "checkpoint-3").mkdir()  # no weights (an unfinished write): skipped
    variants = resolve_checkpoints(["base", str(run / "final"), str(run)])
    assert list(variants) == ["base", "my-run/final", "my-run/checkpoint-2", "my-run/checkpoint-10"]
    assert variants["base"] is True and variants["my-run/checkpoint-10"] == run / "checkpoint-10"
    assert checkpoint_step("my-run/checkpoint-10") == 10
    with pytest.raises(ValueError, match="listed twice"):
        resolve_checkpoints(["base", str(run / "final"), str(run / "final")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither 'base'"):
        resolve_checkpoints([str(tmp_path / "empty")])
    # a path that does not exist says so (it said "neither 'base', a folder ... nor a run folder"), listing the
    # checkpoint folders beside it in step order (checkpoint-3 holds no weights)
    with pytest.raises(FileNotFoundError) as info:
        resolve_checkpoints(["base", str(run / "finall")])
    assert str(info.value) == (f"checkpoints: {str(run / 'finall')!r} does not exist ({str(run)!r} holds "
                               "checkpoint-2, checkpoint-10, final); pass the checkpoint-<step>/ or final/ folder of a "
                               "diffalign-train run, e.g. checkpoints=[base,runs/my-run/final]")


def test_eval_command_refuses_a_checkpoint_that_does_not_exist_before_any_model_loads(monkeypatch):
    """``diffalign-eval checkpoint=/nope/final`` said "... holds no pytorch_lora_weights.safetensors"."""
    import diffusers

    from diffalign import cli

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", refuse)
    monkeypatch.setattr(cli, "_evaluate", refuse)
    with pytest.raises(SystemExit) as info:
        cli._eval_main(compose_cfg(["checkpoint=/nope/final"], name="evaluate"))
    assert str(info.value.code) == ("diffalign: error: checkpoint='/nope/final' does not exist; pass the "
                                    "checkpoint-<step>/ or final/ folder of a diffalign-train run, e.g. "
                                    "checkpoint=runs/my-run/final")


def test_an_interrupted_evaluation_resumes_without_recomputing_finished_prompts(tmp_path, monkeypatch):
    lora = _lora_dir(tmp_path, "lora", seed=1)
    rows = _rows(4)
    cfg = EvalConfig(seeds=[0, 1], sampler={"name": "ode", "num_inference_steps": 2}, batch_size=2,  # a prompt a batch
                     reuse_base=False)  # "ref" beside "ev" would otherwise give "ev" its base samples
    variants = {"base": True, "ft": lora}

    def run(out, reward):
        return evaluate_policy(build_tiny_random_policy(seed=0), rows, {"v": reward, "mean": ImageMean()}, cfg,
                               tmp_path / out, variants, progress=False)

    reference = run("ref", KnownOutcomes())
    with pytest.raises(KeyboardInterrupt):
        run("ev", KnownOutcomes(fail_on_call=7))  # base: 4 prompts done; ft: prompts 0 and 1 done, 2 interrupted
    lines = (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == (4 + 2) * 2
    sampled = []
    original = generation_module.rollout
    monkeypatch.setattr(generation_module, "rollout", lambda policy, prompts, sampler, **kw: (
        sampled.extend(prompts), original(policy, prompts, sampler, **kw))[1])
    resumed = run("ev", KnownOutcomes())
    assert sampled == [rows[2]["prompt"]] * 2 + [rows[3]["prompt"]] * 2  # only ft's unfinished prompts
    assert resumed["variants"] == reference["variants"] and resumed["ft_vs_base"] == reference["ft_vs_base"]
    assert (tmp_path / "ev" / "samples.jsonl").read_text() == (tmp_path / "ref" / "samples.jsonl").read_text()
    # a finished evaluation re-runs nothing; a changed checkpoint is recomputed, and only that one
    sampled.clear()
    run("ev", KnownOutcomes())
    assert sampled == []
    shutil.copy(_lora_dir(tmp_path, "other", seed=2) / "pytorch_lora_weights.safetensors", lora)
    run("ev", KnownOutcomes())
    assert sampled == [r["prompt"] for r in rows for _ in range(2)]


def test_video_samples_are_written_as_gif_and_shown_by_their_first_frame(tmp_path, monkeypatch):
    original = evaluate_module.sample_images
    monkeypatch.setattr(evaluate_module, "sample_images", lambda *a, **kw: original(*a, **kw).unsqueeze(1).repeat(
        1, 3, 1, 1, 1) * torch.linspace(0.2, 1.0, 3).view(1, 3, 1, 1, 1))  # (N, F=3, C, H, W)
    metrics = evaluate_policy(build_tiny_random_policy(seed=0), _rows(2), {"v": KnownOutcomes()},
                              EvalConfig(seeds=[0], sampler={"name": "ode", "num_inference_steps": 1}), tmp_path,
                              {"base": True}, progress=False)
    sample = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    gif = Image.open(tmp_path / sample["video"])
    assert sample["video"].endswith(".gif") and gif.n_frames == 3
    assert (tmp_path / sample["image"]).is_file() and metrics["variants"]["base"]["num_images"] == 2
    from diffalign.evaluation.report import write_report

    assert sample["video"] in write_report(tmp_path).read_text()


def test_save_video_writes_gif_and_mp4(tmp_path):
    import imageio.v2 as imageio

    frames = torch.zeros(5, 3, 17, 20)
    frames[:, 0] = torch.linspace(0, 1, 5).view(5, 1, 1)  # red ramps up over time
    gif = save_video(frames, tmp_path / "v.gif", fps=10)
    im = Image.open(gif)
    assert im.n_frames == 5 and im.size == (20, 17)
    im.seek(4)
    assert im.convert("RGB").getpixel((3, 3)) == (255, 0, 0)
    mp4 = np.stack(imageio.mimread(save_video(frames, tmp_path / "v.mp4", fps=10), format="FFMPEG"))
    assert mp4.shape == (5, 18, 20, 3)  # padded to even sizes for H.264
    assert abs(int(mp4[4, 3, 3, 0]) - 255) < 20 and abs(int(mp4[0, 3, 3, 0])) < 20
    with pytest.raises(ValueError, match=r"\(F, C, H, W\)"):
        save_video(torch.zeros(3, 8, 8), tmp_path / "x.gif")
    with pytest.raises(ValueError, match="gif or .mp4"):
        save_video(frames, tmp_path / "x.avi")


def test_comparison_lines_give_each_gain_with_its_se_and_ratio():
    """diffalign-eval's console summary (it printed metrics.json's variants and comparisons as indented JSON)."""
    from diffalign.evaluation.metrics import comparison_lines

    metrics = {"labels": ["base", "ft", "ft2"],
               "ft_vs_base": {"r/mean": {"gain": 0.071, "se": 0.0178}, "r/accuracy": {"gain": -0.02, "se": 0.0},
                              "r/win_rate": {"win_rate": 0.614, "ci": [0.551, 0.672]}},
               "ft2_vs_base": {}}
    assert comparison_lines(metrics) == [
        "ft vs base: r/mean +0.071 ± 0.018 (4.0 s.e.); r/accuracy -0.020 ± 0.000; r/win_rate 0.61 [0.55, 0.67]",
        "ft2 vs base: "]
