"""scripts/device_pretrain.py (the GPU machine's one command) on the CPU with tiny sizes, and ``--device`` of the
pretraining scripts: an explicit ``--device cpu`` is the default run bit for bit; a bad one is refused first."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from conftest import load_script, same_state

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "DEVICE": "cpu", "THREADS": "1", "EVALS": "2", "TIME_LIMIT_S": "300",
    "FLOW2_STEPS": "4", "FLUX2_STEPS": "2", "WAN_VAE_STEPS": "2", "WAN_STEPS": "2",
    "FLOW2_ARGS": "--num-latents 16 --unet-batch 4 --flow2-width 32 --flow2-layers 1 --flow2-eval-prompts 2",
    "FLUX2_ARGS": "--num-latents 16 --unet-batch 4 --flux2-heads 2 --flux2-layers 1 --flux2-single-layers 1 "
                  "--flux2-eval-prompts 2",
    "WAN_ARGS": "--wan-vae-dim 8 --wan-vae-batch 2 --wan-width 32 --wan-layers 1 --wan-heads 2 --wan-text-width 32 "
                "--num-videos 8 --batch 2 --eval-prompts 2 --eval-seeds 0 --eval-steps 2",
}


def _device_script(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **TINY, "OUT": str(tmp_path / "out"), "WORK_ROOT": str(tmp_path / "work"),
            "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "device_pretrain.py")], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)


def _world():
    return load_script("pretrain_tiny_world")


@pytest.mark.slow
def test_device_script_runs_three_stages_writes_archives_and_a_summary_and_resumes(tmp_path):
    """First call: flow2 stopped at step 2 (as a timeout would leave it: a checkpoint, exit 3), flux2 and wan finish;
    every stage's archive, log and the summary come back. Second call: flow2 resumes from step 2 to 4, the finished
    stages are not started again, exit 0."""
    first = _device_script(tmp_path, FLOW2_ARGS=TINY["FLOW2_ARGS"] + " --flow2-stop-at 2")
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["flow2.log", "flow2.tar.gz", "flux2.log", "flux2.tar.gz",
                                                     "summary.json", "wan.log", "wan.tar.gz"]
    rows = json.loads((out / "summary.json").read_text())["stages"]
    assert (rows["flow2"]["steps"], rows["flow2"]["finished"]) == (2, False)
    assert (rows["flux2"]["steps"], rows["flux2"]["finished"]) == (2, True)
    assert (rows["wan"]["steps"], rows["wan"]["vae_steps"], rows["wan"]["finished"]) == (2, 2, True)
    assert 0.0 <= rows["flux2"]["heldout_accuracy"] <= 1.0 and rows["flux2"]["loss"] > 0
    summary_lines = [line.split() for line in first.stdout.splitlines() if line.split()[:1] in (["flow2"], ["flux2"],
                                                                                                  ["wan"])]
    assert [(cols[0], cols[1]) for cols in summary_lines] == [("flow2", "2/4"), ("flux2", "2/2"), ("wan", "2/2")]
    with tarfile.open(out / "flux2.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"flux2_checkpoint.pt", "flux2_metrics.json", "train.log", "tiny_flux_wide/model_index.json",
            "tiny_flux_wide/transformer/diffusion_pytorch_model.safetensors"} <= names
    assert "flux2_latents.pt" not in names  # the cache stays in the work folder
    with tarfile.open(out / "wan.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"wan_vae/config.json", "tiny_wan_t2v/model_index.json", "tiny_wan_t2v/pretrain_metrics.json"} <= names
    with tarfile.open(out / "flow2.tar.gz") as tar:
        assert "flow2_checkpoint.pt" in tar.getnames()

    second = _device_script(tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "flux2: finished in an earlier call, not started" in second.stdout
    assert "wan: finished in an earlier call, not started" in second.stdout
    assert "resumed from" in (tmp_path / "work" / "flow2" / "train.log").read_text()
    rows = json.loads((out / "summary.json").read_text())["stages"]
    assert (rows["flow2"]["steps"], rows["flow2"]["finished"]) == (4, True)
    with tarfile.open(out / "flow2.tar.gz") as tar:
        assert "tiny_sd3_wide/model_index.json" in tar.getnames()


def test_device_script_refuses_a_bad_setting_before_any_work(tmp_path):
    res = _device_script(tmp_path, FLOW2_STEPS="many")
    assert res.returncode != 0 and "FLOW2_STEPS='many' is no integer" in res.stderr
    res = _device_script(tmp_path, DEVICE="tpu")
    assert res.returncode != 0 and "--device 'tpu'" in res.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_resolve_device_refuses_what_this_machine_cannot_run():
    world = _world()
    assert world.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SystemExit, match="is no torch device"):
        world.resolve_device("gpu0")
    with pytest.raises(SystemExit, match="train on cpu or cuda"):
        world.resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees no CUDA device here; pass --device cpu"):
            world.resolve_device("cuda")
    else:
        with pytest.raises(SystemExit, match="CUDA device"):
            world.resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.slow
def test_explicit_device_cpu_is_the_default_run_bit_for_bit(tmp_path):
    """flow2, three steps with and without ``--device cpu``: identical checkpoints (weights, EMAs, optimizer, RNG)."""
    from diffalign.config.compose import asset_path

    shutil.copytree(Path(asset_path("tiny_sd3")) / "vae", tmp_path / "out" / "tiny_sd3" / "vae")
    base = [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), "flow2", "--out", str(tmp_path / "out"),
            "--num-latents", "16", "--unet-batch", "4", "--flow2-steps", "3", "--flow2-stop-at", "3", "--flow2-width",
            "32", "--flow2-layers", "1", "--threads", "1"]
    for work, extra in (("default", []), ("cpu", ["--device", "cpu"])):
        res = subprocess.run(base + ["--work", str(tmp_path / work), *extra], capture_output=True, text=True,
                             timeout=600, check=False)
        assert res.returncode == 0, res.stderr[-3000:]
    a = torch.load(tmp_path / "default" / "flow2_checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "cpu" / "flow2_checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 3
    for key in ("modules", "emas", "optimizer", "scheduler", "generator", "torch_rng", "running", "sizes"):
        assert same_state(a[key], b[key]), key
