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


def test_installed_plugin_is_found_by_name_and_scores(installed_plugin):
    result = run_python(installed_plugin,
        "import torch\n"
        "from diffalign.config.registry import entry_point_configs\n"
        "from diffalign.rewards.reward_set import build_reward, build_rewards\n"
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
    result = run_python(installed_plugin,
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
    result = run_python(installed_plugin,
        "from diffalign.rewards.reward_set import build_reward\n"
        "try:\n"
        "    build_reward('nowhere_reward')\n"
        "except ValueError as err:\n"
        "    print(err)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "unknown reward 'nowhere_reward'" in result.stdout
    for name in ("example_saturation", "clip_score", "aesthetic", "pickscore", "hpsv2", "geneval_shapes"):
        assert name in result.stdout
    cli = run_python(installed_plugin, "import sys\nfrom diffalign.cli import train\n"
                     "sys.argv = ['diffalign-train', 'reward=[nowhere_reward]']\ntrain()\n")
    assert cli.returncode != 0 and "nowhere_reward" in cli.stderr and "example_saturation" in cli.stderr
