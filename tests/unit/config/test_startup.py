"""A config mistake is reported before any model library is imported: the config checks (schema discovery, Hydra's
composition, the field checks) import the components' light modules only; diffusers, transformers, peft and
torchvision come with the models (docs/results/performance.md#start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CHILD_ENV, REPO

MODEL_LIBRARIES = ("diffusers", "transformers", "peft", "torchvision")
"""Imported with a model (seconds each on a 2-core machine), never by the config checks."""

CHILD = """
import json, sys
from diffalign import cli
sys.argv = [{command!r}, *{args!r}]
try:
    getattr(cli, {entry!r})()
    message = None
except SystemExit as exit:
    message = str(exit.code)
print(json.dumps({{"message": message, "loaded": sorted(m for m in {libraries!r} if m in sys.modules)}}))
"""


@pytest.mark.parametrize(("entry", "args", "error"), [
    ("train", ["trainer.batch_size=-1"], "diffalign: error: trainer.batch_size must be an integer >= 1, got -1"),
    ("train", ["trainer.max_step=2"], "diffalign: error: trainer.max_step is not a setting of trainer"),
    ("evaluate", ["eval.num_prompts=3"], "diffalign: error: eval.num_prompts is not a setting of eval"),
])
def test_a_config_error_is_said_without_importing_a_model_library(tmp_path, entry, args, error):
    """The command runs in a fresh process (a test process has the libraries imported already); the error line is
    the same as before, and none of `MODEL_LIBRARIES` is in ``sys.modules`` when it is said."""
    code = CHILD.format(command=f"diffalign-{entry}", args=[*args, f"output_dir={tmp_path / 'run'}"], entry=entry,
                        libraries=MODEL_LIBRARIES)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["message"].startswith(error), result["message"]
    assert result["loaded"] == [], f"a config error imported {result['loaded']}: {done.stderr[-1000:]}"
