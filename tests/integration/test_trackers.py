"""Experiment trackers (issue 20 item 6): ``trainer.log_with=wandb`` offline and the default TensorBoard get the
scalars, the monitors' samples (images; videos for a video model) and the evaluation's grids and videos
(`diffalign.runtime.trackers`). The wandb run is read back with wandb's own reader of its offline run files
(``wandb leet inspect --json``), the TensorBoard logs with TensorBoard's ``EventAccumulator``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_cfg, online_overrides, smoke_overrides
from PIL import Image

MONITOR = ["monitor.every=2", "monitor.num_prompts=2", "monitor.seeds=[0]", "monitor.sampler.num_inference_steps=1",
           "monitor.diversity=false"]
EVAL = ["eval.enabled=true", "eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=1"]
VIDEO = ["model=tiny_t2v_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
         "method.timesteps_per_epoch=2", "online.prompts=video_train", "reward=[video_motion]",
         "online.groups_per_epoch=2", "model.num_frames=4", "monitor.every=1", "monitor.prompts=video_heldout",
         "monitor.num_prompts=2", "monitor.seeds=[0]", "monitor.sampler.num_inference_steps=2",
         "monitor.diversity=false"]


def _pixels(path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def _wandb():
    return pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]'; the README's "
                                               "install command brings it with the dev extra)")


def _wandb_run(output_dir: Path) -> tuple[Path, list[dict]]:
    """The offline run folder under ``<output_dir>/logs/wandb`` and its history records, as wandb reads them."""
    runs = sorted((output_dir / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(runs[0])],
                         capture_output=True, text=True, timeout=120, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    history = [r["history"] for r in records if r.get("type") == "history"]
    assert history, out.stdout[-2000:] + out.stderr[-2000:]
    return runs[0], [{"step": h["step"].get("num", 0), **h["item"]} for h in history]


def _at(history: list[dict], step: int) -> dict:
    """Everything logged at `step` (wandb may write one step as several records)."""
    merged = {}
    for h in history:
        if h["step"] == step:
            merged.update(h)
    return merged


@pytest.mark.slow
def test_wandb_offline_run_holds_the_scalars_the_monitor_samples_and_the_eval_grids(tmp_path, monkeypatch):
    _wandb()
    from diffalign.train.preference import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    results = train(compose_cfg(smoke_overrides(run_dir, steps=4) + ["trainer.log_with=wandb", *MONITOR, *EVAL]))
    folder, history = _wandb_run(run_dir)

    # scalars: the loop's own losses, step by step
    for h in results["history_tail"]:
        assert _at(history, h["step"])["loss"] == pytest.approx(h["loss"], rel=1e-6)
    metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
    final = _at(history, 4)
    assert final["eval/finetuned/geneval_shapes/mean"] == pytest.approx(
        metrics["variants"]["finetuned"]["geneval_shapes/mean"])

    # images: the monitors' samples at steps 0, 2, 4, pixel for pixel the PNGs the run wrote, with their prompts
    prompts = (run_dir / "logs" / "samples" / "step-2" / "prompts.txt").read_text().splitlines()
    for step in (0, 2, 4):
        logged = _at(history, step)
        assert logged["monitor/samples._type"] == "images/separated" and logged["monitor/samples.count"] == 2
        assert logged["monitor/samples.captions"] == [p.split("\t", 1)[1] for p in prompts]
        for i, name in enumerate(logged["monitor/samples.filenames"]):
            assert np.array_equal(_pixels(folder / "files" / name),
                                  _pixels(run_dir / "logs" / "samples" / f"step-{step}" / f"{i:03d}.png"))
    # the evaluation's overview grid of each variant
    for label in ("base", "finetuned"):
        (name,) = final[f"eval/{label}/grid.filenames"]
        assert np.array_equal(_pixels(folder / "files" / name), _pixels(run_dir / "eval" / f"{label}_grid.png"))


@pytest.mark.slow
def test_wandb_offline_run_of_a_text_to_video_model_holds_the_sample_videos(tmp_path, monkeypatch):
    _wandb()
    from diffalign.train.online import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose_cfg(VIDEO + online_overrides(tmp_path) + ["trainer.log_with=wandb"])
    train(cfg)
    folder, history = _wandb_run(tmp_path)
    history_file = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    for entry in history_file:  # one measurement per epoch (0 = before training), at the epoch's tracker step
        logged = _at(history, entry["epoch"])
        assert logged["monitor/samples._type"] == "videos" and logged["monitor/samples.count"] == 2
        gifs = sorted((tmp_path / "logs" / "samples" / f"step-{entry['step']}").glob("*.gif"))
        for video, gif in zip(logged["monitor/samples.videos"], gifs, strict=True):
            assert video["_type"] == "video-file"
            assert (folder / "files" / video["path"]).read_bytes() == gif.read_bytes()  # the file itself, 4 frames
            assert Image.open(folder / "files" / video["path"]).n_frames == 4
        if entry["epoch"]:
            assert logged["reward/mean"] == pytest.approx(entry["reward/mean"])


def _tensorboard(logs: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logs / "diffalign"), size_guidance={"images": 0, "scalars": 0})  # (the run's writer)
    acc.Reload()
    return acc


def test_tensorboard_gets_the_monitor_samples_and_the_eval_grids(tmp_path):
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path, steps=2) + ["trainer.log_with=tensorboard", *MONITOR, *EVAL]))
    acc = _tensorboard(tmp_path / "logs")
    images = acc.Tags()["images"]
    assert "monitor/samples" in images and "eval/base/grid" in images and "eval/finetuned/grid" in images
    events = acc.Images("monitor/samples")  # add_images: one grid of the batch per step
    assert [e.step for e in events] == [0, 2]
    grid = acc.Images("eval/base/grid")[0]
    assert grid.step == 2
    decoded = np.asarray(Image.open(io.BytesIO(grid.encoded_image_string)).convert("RGB"))
    assert np.array_equal(decoded, _pixels(tmp_path / "eval" / "base_grid.png"))
    assert "eval/finetuned/geneval_shapes/mean" in acc.Tags()["scalars"]
    plots = tmp_path / "eval" / "plots"  # the report's training curves leave the evaluation's scalars to its tables
    assert (plots / "train_loss.png").is_file() and not list(plots.glob("train_eval_*"))


@pytest.mark.slow
def test_tensorboard_gets_the_sample_videos_as_animated_gifs(tmp_path):
    from diffalign.train.online import train

    train(compose_cfg(VIDEO + online_overrides(tmp_path, epochs=1) + ["trainer.log_with=tensorboard"]))
    acc = _tensorboard(tmp_path / "logs")
    for i in range(2):
        events = acc.Images(f"monitor/samples/{i}")
        assert [e.step for e in events] == [0, 1]  # before training, after epoch 1
        gif = tmp_path / "logs" / "samples" / "step-1" / f"{i:03d}.gif"
        assert events[-1].encoded_image_string == gif.read_bytes()
        assert Image.open(io.BytesIO(events[-1].encoded_image_string)).n_frames == 4
