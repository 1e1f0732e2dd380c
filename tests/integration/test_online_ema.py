"""``online.ema`` in the online loop: the final LoRA (and what is evaluated) is the EMA, the checkpoints hold the live
weights and the EMA's state, and a resumed run ends with the same EMA bit for bit. Each expectation is derived apart
from the EMA code: decay 0 with an update every step makes the EMA the live weights; an interval past the run's
steps leaves it at the initial LoRA (B = 0); the resume compares against the uninterrupted run."""

from __future__ import annotations

import json
import shutil

import torch
from conftest import ONLINE_CASES, compose_cfg, online_overrides
from safetensors.torch import load_file

CASE = ONLINE_CASES["dgpo_sd"]


def _final(run_dir):
    return load_file(run_dir / "final" / "pytorch_lora_weights.safetensors")


def test_decay_zero_every_step_exports_the_live_weights_and_a_late_interval_the_initial_lora(tmp_path):
    from diffalign.train.online import train

    live = train(compose_cfg(CASE + online_overrides(tmp_path / "live", epochs=2)))
    ema = train(compose_cfg(CASE + online_overrides(tmp_path / "ema", epochs=2)
                            + ["online.ema=true", "online.ema_decay=0", "online.ema_update_interval=1"]))
    assert ema["ema"] is True and live["ema"] is False and ema["global_step"] == live["global_step"] > 0
    a, b = _final(tmp_path / "live"), _final(tmp_path / "ema")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-7, rtol=0) for k in a)
    late = train(compose_cfg(CASE + online_overrides(tmp_path / "late", epochs=2)
                             + ["online.ema=true", "online.ema_update_interval=100"]))
    c = _final(tmp_path / "late")
    b_keys = [k for k in c if "lora.up" in k or "lora_B" in k]  # (diffusers: up = B)
    assert b_keys and all(torch.count_nonzero(c[k]) == 0 for k in b_keys)  # never updated: the initial B = 0
    assert any(torch.count_nonzero(a[k]) > 0 for k in b_keys)  # (while the live run's B moved)
    # the checkpoint holds the live weights (resumable), not the EMA
    step = late["global_step"]
    ckpt = load_file(tmp_path / "late" / f"checkpoint-{step}" / "pytorch_lora_weights.safetensors")
    assert any(torch.count_nonzero(ckpt[k]) > 0 for k in b_keys)


def test_a_resumed_run_ends_with_the_same_ema(tmp_path):
    from diffalign.train.online import train

    extra = ["online.ema=true", "online.ema_decay=0.5", "online.ema_update_interval=1"]
    full = train(compose_cfg(CASE + online_overrides(tmp_path / "a", epochs=3) + extra))
    first = json.loads((tmp_path / "a" / "history.jsonl").read_text().splitlines()[0])["step"]
    shutil.copytree(tmp_path / "a" / f"checkpoint-{first}", tmp_path / "b" / f"checkpoint-{first}")
    resumed = train(compose_cfg(CASE + online_overrides(tmp_path / "b", epochs=3) + extra + ["resume=latest"]))
    assert resumed["global_step"] == full["global_step"]
    a, b = _final(tmp_path / "a"), _final(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    step = full["global_step"]
    ea = load_file(tmp_path / "a" / f"checkpoint-{step}" / "ema_state.safetensors")
    eb = load_file(tmp_path / "b" / f"checkpoint-{step}" / "ema_state.safetensors")
    assert ea and set(ea) == set(eb) and all(torch.equal(ea[k], eb[k]) for k in ea)
