"""Multi-process training (issue 10 item 6): the shipped accelerate configs load, and a 2-process CPU (gloo) launch of
each training loop runs into one run folder. On CPU the launch is
``accelerate launch --multi_gpu --num_processes 2 <script> ... trainer.cpu=true`` (``--cpu`` alone starts one
process; ``trainer.cpu=true`` makes accelerate use gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.utils import DistributedType

from diffalign.cli import CONFIG_DIR

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,kind", [("ddp", DistributedType.MULTI_GPU), ("deepspeed_zero2", DistributedType.DEEPSPEED),
                                       ("fsdp", DistributedType.FSDP)])
def test_shipped_accelerate_configs_load(name, kind):
    config = ClusterConfig.from_yaml_file(str(Path(CONFIG_DIR) / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type == kind and config.num_processes == 2 and not config.use_cpu
    assert config.mixed_precision == "no"  # the run's trainer.mixed_precision decides
    if kind == DistributedType.DEEPSPEED:
        assert config.deepspeed_config["zero_stage"] == 2
    if kind == DistributedType.FSDP:
        assert config.fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD" and config.fsdp_config["fsdp_use_orig_params"]


def launch_two_processes(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom diffalign.cli import train\nsys.argv[0] = 'diffalign-train'\ntrain()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(script), *args, "trainer.cpu=true", "trainer.log_with=none", "eval.enabled=false"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_two_process_preference_run(tmp_path):
    run = tmp_path / "run"
    res = launch_two_processes([f"output_dir={run}", "model=tiny_random", "trainer.max_steps=2", "trainer.batch_size=2",
                                "trainer.checkpointing_steps=1", "trainer.keep_last=-1", "data.num_pairs=16"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("× 4 pairs (batch 2 × accumulation 1 × 2 processes)") == 1  # printed by process 0 only
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((run / "results.json").read_text())["global_step"] == 2
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "run"]  # one run folder


def test_two_process_online_run(tmp_path):
    run = tmp_path / "run"
    res = launch_two_processes([f"output_dir={run}", "model=tiny_random", "method=flow_grpo", "sampler=ddim",
                                "online.num_epochs=2", "online.groups_per_epoch=2", "online.group_size=4",
                                "online.checkpointing_epochs=1", "trainer.keep_last=-1", "trainer.batch_size=4",
                                "sampler.num_inference_steps=4"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["rollouts"] == 16
    assert len(list(run.glob("checkpoint-*"))) == 2


def test_two_process_dgpo_matches_one_process(tmp_path):
    """DGPO with the same global batch: 2 processes × 1 group each vs 1 process × 2 groups. Rollout noise, prompts,
    training timesteps and noise are keyed by global group index, z_g is summed over processes, and DDP averages the
    per-process surrogate gradients, so the final LoRA must agree up to float rounding (stated tolerance 1e-4).
    adam_epsilon=1 makes the update proportional to the gradient: with the default 1e-8, Adam's first steps divide
    each element by its own magnitude and turn rounding on near-zero gradients into differences of up to the lr."""
    from safetensors.torch import load_file

    from diffalign.train.online import train
    from tests.test_cli import compose_cfg

    common = ["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
              "method.num_train_timesteps=2", "online.num_epochs=2", "online.groups_per_epoch=2",
              "online.group_size=4", "online.checkpointing_epochs=2", "sampler.num_inference_steps=4",
              "trainer.learning_rate=10.0", "trainer.lr_warmup_steps=0", "trainer.adam_epsilon=1.0",
              "trainer.max_grad_norm=null"]
    res = launch_two_processes([f"output_dir={tmp_path / 'two'}", "trainer.batch_size=4", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=8", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    one = load_file(tmp_path / "one" / "final" / "pytorch_lora_weights.safetensors")
    two = load_file(tmp_path / "two" / "final" / "pytorch_lora_weights.safetensors")
    assert set(one) == set(two)
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=1e-4)
