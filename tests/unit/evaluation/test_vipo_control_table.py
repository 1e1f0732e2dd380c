"""experiments/vipo_control_table.py: the ViPO/GRPO × verifier/control contrasts and their s.e., checked by hand on
two seeds × two videos."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))  # experiments/vipo_control_table.py
from vipo_control_table import contrasts, per_video

BASE = {"A": 0.5, "B": 0.5}
VERIFIER = {"vipo-s0": {"A": 0.7, "B": 0.5}, "vipo-s1": {"A": 0.5, "B": 0.7},
            "grpo-s0": {"A": 0.5, "B": 0.5}, "grpo-s1": {"A": 0.6, "B": 0.4}}
CONTROL = {"vipo-s0": {"A": 0.5, "B": 0.5}, "vipo-s1": {"A": 0.6, "B": 0.4},
           "grpo-s0": {"A": 0.5, "B": 0.5}, "grpo-s1": {"A": 0.5, "B": 0.5}}


def _write(out: Path, runs: dict, base: dict = BASE) -> Path:
    (out / "eval").mkdir(parents=True)
    rows = []
    for variant, scores in {"base": base, **{f"{k}/final": v for k, v in runs.items()}}.items():
        for index, video in enumerate(sorted(scores)):
            rows.append({"variant": variant, "prompt_index": index, "seed": 0, "video_motion": scores[video],
                         "video_motion/correct": scores[video] > 0.6})
    (out / "eval" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out


def test_contrasts_by_hand(tmp_path):
    v = per_video(_write(tmp_path / "v", VERIFIER), "video_motion")["dense"]
    c = per_video(_write(tmp_path / "c", CONTROL), "video_motion")["dense"]
    out = contrasts(v, c)
    # vipo verifier − base: seed 0 (+0.2, 0), seed 1 (0, +0.2). Seed means and video means are all 0.1, so the s.e.
    # over seeds and over videos are 0; the residuals are ±0.1, MS_res = 0.04 / 1 df, Var = 0.04 / (2·2): s.e. 0.1.
    r = out["vipo verifier − base"]
    assert r["mean"] == pytest.approx(0.1) and r["per_seed"] == pytest.approx([0.1, 0.1])
    assert r["se_seeds"] == pytest.approx(0.0, abs=1e-12) and r["se_videos"] == pytest.approx(0.0, abs=1e-12)
    assert r["se_crossed"] == pytest.approx(0.1) and r["gain_over_se"] == pytest.approx(1.0)
    # interaction (V_vipo − C_vipo) − (V_grpo − C_grpo): seed 0 (+0.2, 0), seed 1 (−0.2, +0.4). Seed means 0.1, 0.1;
    # video means 0, 0.2 (std 0.1414 / √2 = 0.1); residuals ±0.2, MS_res = 0.16 > MS_image = 0.04, so the video
    # component truncates at 0 and Var = 0.16 / 4: s.e. 0.2.
    r = out["interaction"]
    assert r["mean"] == pytest.approx(0.1)
    assert r["se_videos"] == pytest.approx(0.1) and r["se_crossed"] == pytest.approx(0.2)
    # verifier − control for GRPO: seed 0 (0, 0), seed 1 (+0.1, −0.1): mean 0
    assert out["grpo verifier − control"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert out["vipo − grpo (control)"]["per_seed"] == pytest.approx([0.0, 0.0], abs=1e-12)
    # the accuracy reads <reward>/correct: vipo verifier − base is (+1, 0) and (0, +1) over base (0, 0)
    acc = contrasts(per_video(tmp_path / "v", "video_motion")["accuracy"],
                    per_video(tmp_path / "c", "video_motion")["accuracy"])
    assert acc["vipo verifier − base"]["mean"] == pytest.approx(0.5)


def test_evaluations_of_different_base_videos_are_refused(tmp_path):
    v = per_video(_write(tmp_path / "v", VERIFIER), "video_motion")["dense"]
    c = per_video(_write(tmp_path / "c", CONTROL, base={"A": 0.5, "B": 0.4}), "video_motion")["dense"]
    with pytest.raises(SystemExit, match="base videos differ"):
        contrasts(v, c)
    with pytest.raises(SystemExit, match="not found"):
        per_video(tmp_path / "missing", "video_motion")
