"""The HTML report: rendered by headless Chromium (grid and metrics table visible), training curves from TensorBoard
logs, and the eval command on a run folder's checkpoints (tiny random model)."""

from __future__ import annotations

import html
import json
import shutil
import subprocess

import numpy as np
import pytest
from conftest import compose_cfg, perturb_lora_, smoke_overrides
from PIL import Image

from diffalign.evaluation.evaluate import evaluate_policy
from diffalign.evaluation.generation import EvalConfig
from diffalign.evaluation.report import read_scalars, write_report
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.rewards.geneval_shapes import GenevalShapes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADER_RGB = (0xD9, 0xE4, 0xF0)  # `th` background in diffalign.evaluation.report.STYLE


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--force-device-scale-factor=1", "--allow-file-access-from-files", *args],
                          capture_output=True, text=True, timeout=120, check=True)


def _find(screen: np.ndarray, patch: np.ndarray) -> tuple[int, int] | None:
    """Top-left corner where `patch` (h, w, 3) appears pixel-exactly in `screen`, or None."""
    h, w = patch.shape[:2]
    ys, xs = np.nonzero((patch != 255).any(-1))  # anchor on the first non-white pixel
    ay, ax = ys[0], xs[0]
    for y, x in zip(*np.nonzero((screen == patch[ay, ax]).all(-1))):
        top, left = y - ay, x - ax
        if top >= 0 and left >= 0 and np.array_equal(screen[top:top + h, left:left + w], patch):
            return int(top), int(left)
    return None


def _write_logs(run_dir, steps: int = 5) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(run_dir / "logs" / "diffalign"))
    for step in range(1, steps + 1):
        writer.add_scalar("loss", 1.0 / step, step)
        writer.add_scalar("reward/mean", 0.1 * step, step)
    writer.close()


def test_html_report_renders_the_grid_and_the_metrics_table_in_headless_chromium(tmp_path):
    if CHROMIUM is None:
        pytest.skip("headless Chromium not found: install Debian's `chromium` package (apt-get install chromium); "
                    "CI (.ci/run) installs it")
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy, seed=1)
    rows = [{"prompt": "a red circle", "tag": "colors"}, {"prompt": "two squares", "tag": "counting"}]
    cfg = EvalConfig(seeds=[0, 1], sampler={"name": "ode", "num_inference_steps": 2})
    metrics = evaluate_policy(policy, rows, {"geneval_shapes": GenevalShapes()}, cfg, tmp_path / "ev",
                              {"base": True, "finetuned": False}, progress=False)
    _write_logs(tmp_path / "run")
    report = write_report(tmp_path / "ev", run_dir=tmp_path / "run")
    assert report == tmp_path / "ev" / "report.html"

    shot = tmp_path / "shot.png"
    _chromium(f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri())
    screen = np.array(Image.open(shot).convert("RGB"))
    grid = np.array(Image.open(tmp_path / "ev" / "grids" / "p00000.png").convert("RGB"))
    assert _find(screen, grid) is not None, "the first prompt's grid is not on the screenshot"
    header_pixels = (screen == HEADER_RGB).all(-1)
    assert header_pixels.sum() > 5000, "no metrics table header on the screenshot"
    assert header_pixels[:800].any(), "the metrics table is not near the top of the page"
    plot = np.array(Image.open(tmp_path / "ev" / "plots" / "train_loss.png").convert("RGB"))
    assert _find(screen, plot) is not None, "the training-curve plot is not on the screenshot"

    dom = _chromium("--dump-dom", report.as_uri()).stdout
    win = metrics["finetuned_vs_base"]["geneval_shapes/win_rate"]["win_rate"]
    assert '<table id="metrics">' in dom and f"{win:.3f}" in dom and "single_object" not in dom
    assert "counting" in dom and "geneval_shapes/accuracy per tag" in dom


def test_training_curves_come_from_the_tensorboard_logs(tmp_path):
    _write_logs(tmp_path)
    scalars = read_scalars(tmp_path / "logs")
    assert scalars["loss"] == [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert read_scalars(tmp_path / "nothing") == {}
    with pytest.raises(FileNotFoundError, match="metrics.json"):
        write_report(tmp_path / "nothing")


def test_main_job_and_eval_command_write_the_report_with_curves(tmp_path, capsys):
    from diffalign.cli import _eval_main
    from diffalign.train.preference import train

    run = tmp_path / "run"
    evals = ["eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=1"]
    results = train(compose_cfg(smoke_overrides(run, steps=2) + ["trainer.log_with=tensorboard",
                                                                 "eval.enabled=true", *evals]))
    assert results["report"] == str(run / "eval" / "report.html")
    html = (run / "eval" / "report.html").read_text()
    assert "plots/train_loss.png" in html and (run / "eval" / "plots" / "train_loss.png").is_file()
    assert "[diffalign] report:" in capsys.readouterr().out

    # every checkpoint of the run, after the base; the report plots the rewards against the step
    cfg = compose_cfg(["model=tiny_random", f"checkpoints=[base,{run}]", f"output_dir={tmp_path / 'ev'}", *evals],
                      name="evaluate")
    _eval_main(cfg)
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["labels"] == ["base", "run/checkpoint-1", "run/checkpoint-2"]
    assert metrics["steps"] == {"base": None, "run/checkpoint-1": 1, "run/checkpoint-2": 2}
    html = (tmp_path / "ev" / "report.html").read_text()
    assert "plots/eval_geneval_shapes.png" in html and "plots/train_loss.png" in html  # run_dir found by itself
    assert "run/checkpoint-2 geneval_shapes win rate" not in html and "geneval_shapes win rate over base" in html
    with pytest.raises(SystemExit, match="not both"):
        _eval_main(compose_cfg(["model=tiny_random", f"checkpoints=[{run}]", f"checkpoint={run / 'final'}"],
                               name="evaluate"))


@pytest.mark.parametrize("flow, sampler, expected", [
    (False, {"name": "ode"}, "2 DDIM steps, η 0.0"),
    (True, {"name": "ode"}, "2 Euler ODE steps"),
    (True, {"name": "flow_sde", "noise_level": 0.7}, "2 flow SDE steps (Flow-GRPO's, a = 0.7)"),
    (True, {"name": "dance_sde", "noise_level": 0.3}, "2 dance_sde steps, noise_level 0.3"),
])
def test_the_header_names_the_sampler_the_evaluation_used(tmp_path, flow, sampler, expected):
    """A flow model is sampled with the Euler ODE (``sampler=ode``) or the sampler of ``eval.sampler``, never DDIM: the
    header said "DDIM steps … η" for every model. A checkpoint whose label is its value ("base") is named once."""
    from diffalign.models.tiny_flow import build_tiny_flow_policy

    policy = build_tiny_flow_policy(seed=0) if flow else build_tiny_random_policy(seed=0)
    rows = [{"prompt": "a red circle", "tag": "colors"}]
    cfg = EvalConfig(seeds=[0], sampler={**sampler, "num_inference_steps": 2, "guidance_scale": 3.0})
    metrics = evaluate_policy(policy, rows, {"geneval_shapes": GenevalShapes()}, cfg, tmp_path / "ev",
                              {"base": True, "finetuned": False}, progress=False)
    assert metrics["sampler"] == expected
    page = write_report(tmp_path / "ev").read_text()
    assert html.escape(expected) in page and ("DDIM" in page) == (not flow)
    assert "guidance 3.0;" in page  # (read from the config's sampler node)
    assert "<b>base</b>, <b>finetuned</b> = policy" in page and "base</b> = base" not in page
