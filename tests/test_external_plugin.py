"""An external reward package (tests/plugins/diffalign_example_reward) installed with pip and discovered through its
``diffalign.rewards`` entry point, as a user's own plugin would be.

The README's set-up command does not install it; this module installs it into the running environment once
(``pip install --no-deps --no-build-isolation -e``: no download, no network) and checks discovery in a fresh
interpreter, so the README's two commands stay the whole CI."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).resolve().parent / "plugins" / "diffalign_example_reward"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed_plugin():
    names = {ep.name for ep in importlib.metadata.entry_points(group="diffalign.rewards")}
    if "example_saturation" not in names:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                                 "--no-index", "-e", str(PLUGIN_DIR)], capture_output=True, text=True, timeout=300,
                                check=False)
        assert result.returncode == 0, result.stdout + result.stderr
    # the editable install's .pth is read at interpreter start-up; make the package importable in this process too,
    # since its entry point is now visible to every later test in it
    if str(PLUGIN_DIR) not in sys.path:
        sys.path.append(str(PLUGIN_DIR))
        importlib.invalidate_caches()
    return PLUGIN_DIR


def run_python(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (entry points and editable-install paths are read at start-up)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})


def test_installed_plugin_is_found_by_name_and_scores(installed_plugin):
    result = run_python(
        "import torch\n"
        "from diffalign.plugins import build_reward, build_rewards, entry_point_configs\n"
        "configs = entry_point_configs()\n"
        "assert configs['example_saturation'].__module__ == 'diffalign_example_reward', configs\n"
        "reward = build_reward('example_saturation', scale=2.0)\n"
        "x = torch.zeros(2, 3, 4, 4); x[1, 0] = 1.0\n"
        "print(reward(x, ['a', 'b']).scores.tolist())\n"
        "combined = build_rewards({'example_saturation': {'weight': 0.5}, 'jpeg_compressibility': None})\n"
        "print(sorted(combined.rewards), combined.weights['example_saturation'])\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "[0.0, 2.0]"
    assert lines[1] == "['example_saturation', 'jpeg_compressibility'] 0.5"


def test_installed_plugin_is_selectable_on_the_command_line(installed_plugin):
    result = run_python(
        "import sys\n"
        "from diffalign.cli import train\n"
        "sys.argv = ['diffalign-train', '--cfg', 'job', 'reward=[geneval_shapes,example_saturation]',\n"
        "            'reward.example_saturation.weight=0.25', 'eval_reward=[example_saturation]']\n"
        "train()\n"
    )
    assert result.returncode == 0, result.stderr
    assert "example_saturation:" in result.stdout and "weight: 0.25" in result.stdout
    assert "_target_: diffalign_example_reward.Saturation" in result.stdout


def test_a_name_that_exists_nowhere_lists_the_available_rewards(installed_plugin):
    result = run_python(
        "from diffalign.plugins import build_reward\n"
        "try:\n"
        "    build_reward('nowhere_reward')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "unknown reward 'nowhere_reward'" in result.stdout
    for name in ("example_saturation", "clip_score", "aesthetic", "pickscore", "hpsv2", "geneval_shapes"):
        assert name in result.stdout
    cli = run_python("import sys\nfrom diffalign.cli import train\n"
                     "sys.argv = ['diffalign-train', 'reward=[nowhere_reward]']\ntrain()\n")
    assert cli.returncode != 0 and "nowhere_reward" in cli.stderr and "example_saturation" in cli.stderr
