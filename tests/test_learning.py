"""CI-sized learning checks: a method must visibly learn the toy `brightness` reward in a few epochs (issue 17).

The thresholds come from runs reproduced by the command in each test's docstring, on the 2-core CPU; each test asserts
a margin well inside the seeds' spread, so a regression that stops learning (a sign, a stalled update) fails it while
seed-to-seed noise does not.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

TRAIN = "import sys; sys.argv = ['diffalign-train'] + sys.argv[1:]; from diffalign.cli import train; train()"


def _train(tmp_path, *overrides) -> dict:
    out = tmp_path / "run"
    subprocess.run([sys.executable, "-c", TRAIN, f"output_dir={out}", "trainer.log_with=none",
                    "online.checkpointing_epochs=null", "eval.reuse_base=false", *overrides],
                   check=True, cwd=REPO, capture_output=True)
    return json.loads((out / "results.json").read_text())["eval"]


@pytest.mark.slow
def test_vipo_raises_held_out_brightness_within_six_epochs(tmp_path):
    """ViPO (per-position advantages, the tiny SD3-format model), one update per epoch at lr 1e-2, 6 epochs x 64
    rollouts. Measured with exactly these overrides, seeds 0/1/2: held-out brightness 0.063 -> 0.118 / 0.157 / 0.282
    (paired gains +0.055 ± 0.014, +0.093 ± 0.012, +0.218 ± 0.028 over 12 prompts x 1 seed). The assertion asks for
    +0.02 at 1.5 paired s.e. (seed 0: 4.0 s.e.). The same run with the recipe's two updates per epoch (the second one
    mostly clipped, docs/learning.md) gives +0.003 ± 0.004 and fails it."""
    ev = _train(tmp_path, "recipe=tiny_vipo_image", "reward=[brightness]", "eval_reward=[brightness]",
                "online.num_epochs=6", "online.updates_per_epoch=1", "trainer.learning_rate=1e-2",
                "eval.prompts_per_tag=2", "eval.seeds=[0]", "seed=0")
    gain = ev["finetuned_vs_base"]["brightness/mean_gain"]
    assert ev["variants"]["base"]["brightness/mean"] == pytest.approx(0.0634, abs=2e-3)
    assert gain["gain"] > 0.02 and gain["gain_over_se"] > 1.5, gain
