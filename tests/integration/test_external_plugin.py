"""An external reward package (tests/plugins/diffalign_example_reward) installed with pip and discovered through its
``diffalign.rewards`` entry point, as a user's own plugin would be.

The README's set-up command does not install it; this module installs it once into a folder of its own (``pip install
--no-deps --no-build-isolation --no-index --target``: no download, no network, the environment untouched, so tests
running beside these in other pytest-xdist workers never see a half-installed plugin) and checks discovery in fresh
interpreters that have that folder on ``PYTHONPATH``, as a site-packages of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugins" / "diffalign_example_reward"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """The folder the plugin is installed into (its package and its ``.dist-info`` with the entry point)."""
    target = tmp_path_factory.mktemp("plugin_site")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                             "--no-index", "--target", str(target), str(PLUGIN_DIR)], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert any(target.glob("diffalign_example_reward*.dist-info")), sorted(p.name for p in target.iterdir())
    return target


def run_python(site: Path, code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (entry points are read from the ``.dist-info`` folders on its path), with
    `site` (the plugin's install folder) on ``PYTHONPATH``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env=env)


# One fresh interpreter runs every check below (each interpreter start imports torch, diffusers and every reward:
# ~20 s on 2 cores); the two command lines run first, before anything else in that interpreter has read the entry
# points. Each part's stdout, stderr and exit status (a string exit code is what Python prints to stderr) come back
# as JSON on the last line of stdout.
CHECKS = """
import contextlib, io, json, sys
results = {}

def part(name, body):
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            body()
        except SystemExit as ended:
            code = ended.code if isinstance(ended.code, int) else 1
            if isinstance(ended.code, str):
                print(ended.code, file=sys.stderr)
    results[name] = {"stdout": out.getvalue(), "stderr": err.getvalue(), "returncode": code}

def cli(*args):
    def body():
        from diffalign.cli import train
        sys.argv = ['diffalign-train', *args]
        train()
    return body

def scores():
    import torch
    from diffalign.config.registry import entry_point_configs
    from diffalign.rewards.reward_set import build_reward, build_rewards
    configs = entry_point_configs()
    assert configs['example_saturation'].__module__ == 'diffalign_example_reward', configs
    reward = build_reward('example_saturation', scale=2.0)
    x = torch.zeros(2, 3, 4, 4); x[1, 0] = 1.0
    print(reward(x, ['a', 'b']).scores.tolist())
    combined = build_rewards({'example_saturation': {'weight': 0.5}, 'jpeg_compressibility': None})
    print(sorted(combined.rewards), combined.weights['example_saturation'])

def unknown():
    from diffalign.rewards.reward_set import build_reward
    try:
        build_reward('nowhere_reward')
    except ValueError as err:
        print(err)

part("cli_select", cli('--cfg', 'job', 'reward=[geneval_shapes,example_saturation]',
                       'reward.example_saturation.weight=0.25', 'eval_reward=[example_saturation]'))
part("cli_unknown", cli('reward=[nowhere_reward]'))
part("unknown", unknown)
part("scores", scores)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def plugin_checks(installed_plugin) -> dict[str, dict]:
    """Each part of `CHECKS` (run once, in one fresh interpreter with the plugin installed): its stdout, stderr and
    exit status."""
    import json

    result = run_python(installed_plugin, CHECKS)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_installed_plugin_is_found_by_name_and_scores(plugin_checks):
    result = plugin_checks["scores"]
    assert result["returncode"] == 0, result["stderr"]
    lines = result["stdout"].strip().splitlines()
    assert lines[0] == "[0.0, 2.0]"
    assert lines[1] == "['example_saturation', 'jpeg_compressibility'] 0.5"


def test_installed_plugin_is_selectable_on_the_command_line(plugin_checks):
    result = plugin_checks["cli_select"]
    assert result["returncode"] == 0, result["stderr"]
    assert "example_saturation:" in result["stdout"] and "weight: 0.25" in result["stdout"]
    assert "_target_: diffalign_example_reward.Saturation" in result["stdout"]


def test_a_name_that_exists_nowhere_lists_the_available_rewards(plugin_checks):
    result = plugin_checks["unknown"]
    assert result["returncode"] == 0, result["stderr"]
    assert "unknown reward 'nowhere_reward'" in result["stdout"]
    for name in ("example_saturation", "clip_score", "aesthetic", "pickscore", "hpsv2", "geneval_shapes"):
        assert name in result["stdout"]
    cli = plugin_checks["cli_unknown"]
    assert cli["returncode"] != 0 and "nowhere_reward" in cli["stderr"] and "example_saturation" in cli["stderr"]
