"""``diffalign-train -m`` (a Hydra sweep): every job runs in its own folder, ``<output_dir>/<job number>``, with its own
checkpoints, final LoRA and saved config; a sweep refused at its first job leaves no folder behind."""

from __future__ import annotations

import sys

import pytest
import yaml
from conftest import smoke_overrides

SWEEP_ARGS = ("hydra/job_logging=none", "hydra/hydra_logging=none")


def _run(monkeypatch, args):
    from diffalign import cli

    monkeypatch.setattr(sys, "argv", ["diffalign-train", "-m", *args, *SWEEP_ARGS])
    cli.train()


def test_each_job_of_a_sweep_trains_in_its_own_folder(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep"
    overrides = [o for o in smoke_overrides(tmp_path) if not o.startswith("output_dir=")]
    _run(monkeypatch, [f"output_dir={sweep}", "seed=0,1", *overrides])
    for job, seed in (("0", 0), ("1", 1)):
        folder = sweep / job
        assert (folder / "final" / "pytorch_lora_weights.safetensors").is_file(), sorted(folder.iterdir())
        assert (folder / "checkpoint-2").is_dir()
        saved = yaml.safe_load((folder / ".hydra" / "config.yaml").read_text())
        assert saved["seed"] == seed
    assert not list(sweep.glob("checkpoint-*")) and not (sweep / "final").exists()  # nothing in the sweep's folder
    a, b = ((sweep / j / "final" / "pytorch_lora_weights.safetensors").read_bytes() for j in "01")
    assert a != b  # two seeds, two runs (not one run written twice)


def test_a_sweep_refused_at_its_first_job_leaves_no_folder(tmp_path, monkeypatch):
    sweep = tmp_path / "runs" / "sweep"
    with pytest.raises(SystemExit) as stopped:
        _run(monkeypatch, [f"output_dir={sweep}", "method.beta=0,-1"])
    assert str(stopped.value.code).startswith("diffalign: error: method.beta=0.0 must be > 0")
    assert not (tmp_path / "runs").exists()
