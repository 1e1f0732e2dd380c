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
from conftest import REPO

from diffalign.config.compose import CONFIG_DIR

pytestmark = pytest.mark.slow  # each test launches two processes (≈ 8 s)



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


def launch_two_processes(args: list[str], tmp_path: Path, prelude: str = "") -> subprocess.CompletedProcess:
    """``diffalign-train <args>`` on 2 CPU processes from `tmp_path`, after the Python `prelude` (e.g. a patch); without
    a prelude, as the docs launch it: ``accelerate launch ... -m diffalign.cli <args>``."""
    script = tmp_path / "train.py"
    script.write_text(f"{prelude}\nimport sys\nfrom diffalign.cli import train\nsys.argv[0] = 'diffalign-train'\n"
                      "train()\n")
    target = [str(script)] if prelude else ["-m", "diffalign.cli"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), *target, *args, "trainer.cpu=true", "trainer.log_with=none", "eval.enabled=false"]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


# Updates proportional to the gradient (Adam eps 1, lr 10, no clipping): with Adam's default epsilon its first
# steps divide each element by its own magnitude and turn float rounding on near-zero gradients into differences of
# up to the lr. With these settings a run whose gradients are not synchronised fails the 1e-4 tolerance.
LINEAR_UPDATES = ["trainer.optimizer.lr=10.0", "trainer.lr_warmup_steps=0", "trainer.optimizer.eps=1.0",
                  "trainer.max_grad_norm=null"]


def assert_same_lora(one: Path, two: Path, atol: float = 1e-4) -> None:
    from safetensors.torch import load_file

    a = load_file(one / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(two / "final" / "pytorch_lora_weights.safetensors")
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=atol)
    # training moved the weights: LoRA's up/B matrices start at zero
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k or "lora.up" in k) > 10 * atol


def test_launch_time_is_the_launchers_on_every_process():
    """docs/guides/field_cases.md#one-run-folder-for-all-processes: two processes of one launch resolving the default
    run folder at 12:00:00 and 12:00:01 get the same folder (the launcher's start time); one process gets its clock; a
    multi-node launch or an unreadable launcher asks for output_dir."""
    from datetime import datetime

    from diffalign.runtime.launch import launch_time

    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    started = datetime(2026, 1, 1, 11, 59, 58).timestamp()
    rank0 = launch_time("%Y%m%d-%H%M%S", env={**env, "RANK": "0"}, now=lambda: datetime(2026, 1, 1, 12, 0, 0),
                        launcher_start=lambda: started)
    rank1 = launch_time("%Y%m%d-%H%M%S", env={**env, "RANK": "1"}, now=lambda: datetime(2026, 1, 1, 12, 0, 1),
                        launcher_start=lambda: started)
    assert rank0 == rank1 == "20260101-115958"
    assert launch_time("%H%M%S", env={}, now=lambda: datetime(2026, 1, 1, 12, 0, 1)) == "120001"
    assert launch_time("%H%M%S", env={**env, "DIFFALIGN_LAUNCH_TIME": str(started)}) == "115958"
    with pytest.raises(ValueError, match="output_dir"):
        launch_time("%H", env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="output_dir"):
        launch_time("%H", env=env, launcher_start=lambda: None)


def test_process_start_time_reads_proc():
    import time

    from diffalign.runtime.launch import process_start_time

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        start = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    if start is None:
        pytest.skip("no /proc on this system")
    assert before - 1.5 <= start <= time.time() + 1.5  # /proc/stat's btime has 1 s resolution
    assert process_start_time(2**22 + 12345) is None


def test_two_process_preference_run_matches_one_process(tmp_path):
    """Diffusion-DPO: 2 processes × batch 2 vs 1 process × batch 4, same global batches (process r takes slice r)
    and the same per-sample (t, ε) (keyed by the sample's global position): same LoRA within 1e-4. The 2-process run
    leaves its output_dir to the default, run from `tmp_path`: both processes write into one folder."""
    from conftest import compose_cfg

    from diffalign.train.preference import train

    common = ["model=tiny_random", "trainer.max_steps=2", "trainer.checkpointing_steps=1", "trainer.keep_last=-1",
              "data=shapes_pairs", "data.num_pairs=16", *LINEAR_UPDATES, "trainer.optimizer.lr=1.0"]
    # (lr 10: a first DPO step that large sends step 2 where rounding differences of 1e-5 grow to 6e-4)
    res = launch_two_processes(["trainer.batch_size=2", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("× 4 pairs (batch 2 × accumulation 1 × 2 processes)") == 1  # printed by process 0 only
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("train-"), runs  # one run folder for both processes
    run = runs[0]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert len(list(run.rglob("config.yaml"))) == 1  # one .hydra/config.yaml
    assert json.loads((run / "results.json").read_text())["global_step"] == 2
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=4", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    assert_same_lora(tmp_path / "one", run)


def test_repeating_warnings_are_summed_over_the_processes_and_said_once(tmp_path):
    """Every pair counts as saturated (z > -inf): each process counts its own slice (batch 2), the summary sums them,
    2 processes × 2 pairs × 2 steps = 8 of 8 pairs, in one line (the main process's) and in results.json
    (diffalign.runtime.console)."""
    prelude = "import diffalign.objectives.diffusion_dpo as dpo\ndpo.SATURATION_THRESHOLD = float('-inf')"
    res = launch_two_processes([f"output_dir={tmp_path / 'run'}", "model=tiny_random", "trainer.max_steps=2",
                                "trainer.batch_size=2", "trainer.warnings_every=2", "data=shapes_pairs",
                                "data.num_pairs=16"], tmp_path, prelude)
    assert res.returncode == 0, res.stderr[-3000:]
    said = [line for line in (res.stdout + res.stderr).splitlines() if "Diffusion-DPO:" in line]
    assert len(said) == 1 and "steps 1-2: Diffusion-DPO: 8 of 8 pairs had z > -inf" in said[0], said
    totals = json.loads((tmp_path / "run" / "results.json").read_text())["warnings"]
    assert totals["saturated"]["count"] == 8 and totals["saturated"]["of"] == 8


@pytest.mark.parametrize("method,extra", [
    ("flow_grpo", []),
    ("ddpo", ["online.tracker_buffer_size=8", "online.tracker_min_count=2"]),  # per-prompt statistics, gathered
])
def test_two_process_policy_gradient_matches_one_process(method, extra, tmp_path):
    """Flow-GRPO / DDPO with the same global batch (2 groups × 4, 2 epochs): 2 processes × 1 group × batch 2 vs 1
    process × 2 groups × batch 4. Rollouts are keyed by global group, advantages computed from the gathered rewards,
    the minibatches stratified by group (each process's minibatch m is its share of the global minibatch m), and DDP
    averages the gradients: same LoRA within 1e-4."""
    from conftest import compose_cfg

    from diffalign.train.online import train

    common = ["model=tiny_random", f"method={method}", "sampler=ddim", "online.num_epochs=2",
              "online.groups_per_epoch=2", "online.group_size=4", "online.checkpointing_epochs=1",
              "online.updates_per_epoch=2", "trainer.keep_last=-1", "sampler.num_inference_steps=4", *LINEAR_UPDATES,
              *extra]
    res = launch_two_processes([f"output_dir={tmp_path / 'two'}", "trainer.batch_size=2", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    history = [json.loads(line) for line in (tmp_path / "two" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["rollouts"] == 16
    assert len(list((tmp_path / "two").glob("checkpoint-*"))) == 2
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=4", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    assert_same_lora(tmp_path / "one", tmp_path / "two")


def test_two_process_dgpo_matches_one_process(tmp_path):
    """DGPO with the same global batch: 2 processes × 1 group each vs 1 process × 2 groups. Rollout noise, prompts,
    training timesteps and noise are keyed by global group index, z_g is summed over processes, and DDP averages the
    per-process surrogate gradients, so the final LoRA must agree up to float rounding (stated tolerance 1e-4).
    trainer.optimizer.eps=1 makes the update proportional to the gradient: with the default 1e-8, Adam's first steps
    divide each element by its own magnitude and turn rounding on near-zero gradients into differences of up to the lr."""
    from conftest import compose_cfg

    from diffalign.train.online import train

    common = ["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
              "method.timesteps_per_epoch=2", "online.num_epochs=2", "online.groups_per_epoch=2",
              "online.group_size=4", "online.checkpointing_epochs=2", "sampler.num_inference_steps=4",
              *LINEAR_UPDATES]
    res = launch_two_processes([f"output_dir={tmp_path / 'two'}", "trainer.batch_size=4", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=8", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    assert_same_lora(tmp_path / "one", tmp_path / "two")


def test_dgpo_groups_spanning_two_processes_match_one_process(tmp_path):
    """online.split=members: one group of 4 spread over 2 processes (members 0-1 and 2-3) vs the whole group on one
    process. Each member's rollout noise depends only on (seed, epoch, group, member), rewards are gathered before
    the advantages, z_g is summed over the processes by group id: same LoRA within 5e-4. (beta 1e4 multiplies the
    float32 rounding of the log-prob differences, which the two layouts sum in different orders, by 1e4: with
    torch 2.14 the two runs differ by up to 2e-4 on a few near-zero weights, where 1e-4 passed with earlier torch;
    the weights must still have moved by more than ten times the tolerance.)"""
    from conftest import compose_cfg

    from diffalign.train.online import train

    common = ["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
              "method.timesteps_per_epoch=2", "online.num_epochs=2", "online.groups_per_epoch=1",
              "online.group_size=4", "online.checkpointing_epochs=2", "sampler.num_inference_steps=4",
              "online.split=members", "method.beta=1e4", "reward=[jpeg_compressibility]", *LINEAR_UPDATES]
    # (a reward that varies within the group and a beta that puts z_g near 1: the group sum changes the weight)
    res = launch_two_processes([f"output_dir={tmp_path / 'two'}", "trainer.batch_size=2", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    history = [json.loads(line) for line in (tmp_path / "two" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["rollouts"] == 8  # 2 epochs × 1 group × 4, not duplicated
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=4", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    assert_same_lora(tmp_path / "one", tmp_path / "two", atol=5e-4)


def test_two_process_diffusion_nft_matches_one_process(tmp_path):
    """DiffusionNFT with the same global batch on 2 processes × 1 group (micro-batch 2) and on 1 process × 2 groups
    (micro-batch 4): rollouts, timestep permutations and ε are keyed by global group and member, the minibatches are
    stratified by group, DDP averages the gradients and v_old's soft update is the same on every process: same LoRA
    within 1e-4."""
    from conftest import compose_cfg

    from diffalign.train.online import train

    common = ["model=tiny_flow_random", "method=diffusion_nft", "sampler=dpm_ode", "sampler.guidance_scale=1",
              "online.num_epochs=2", "online.groups_per_epoch=2", "online.group_size=4", "online.updates_per_epoch=2",
              "online.checkpointing_epochs=2", "sampler.num_inference_steps=4", "method.old_policy_decay_rate=0.2",
              *LINEAR_UPDATES]
    res = launch_two_processes([f"output_dir={tmp_path / 'two'}", "trainer.batch_size=2", *common], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    train(compose_cfg([f"output_dir={tmp_path / 'one'}", "trainer.batch_size=4", "trainer.log_with=none",
                       "eval.enabled=false", *common]))
    assert_same_lora(tmp_path / "one", tmp_path / "two")


COUNT_SYNCS = """
import atexit, json, os, sys
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
import diffalign.train.online as online
calls = []
prepare = online.prepare_training
def counted(accelerator, policy, tr, total_updates):  # a DDP comm hook that counts the gradient reductions
    out = prepare(accelerator, policy, tr, total_updates)
    def hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)
    policy.forward_module.register_comm_hook(None, hook)
    return out
online.prepare_training = counted
atexit.register(lambda: open(os.path.join(os.environ["COUNT_DIR"], f"rank{os.environ['RANK']}.json"), "w").write(
    json.dumps({"calls": len(calls), "buckets": len(set(calls))})))
from diffalign.cli import train
sys.argv[0] = 'diffalign-train'
train()
"""


def test_the_online_loop_synchronises_gradients_once_per_update(tmp_path):
    """Each process accumulates all micro-batches of an update (here 2 minibatches × 4 transitions = 8 per update)
    and the gradients are reduced across the processes once per update, at its last micro-batch (`no_sync` on the
    others): a DDP comm hook sees one reduction per bucket per update, not one per micro-batch."""
    script = tmp_path / "train.py"
    script.write_text(COUNT_SYNCS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "COUNT_DIR": str(tmp_path)}
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(script), "model=tiny_flow_random", "method=flow_grpo", "sampler=flow_sde",
               "method.timestep_fraction=1.0", f"output_dir={out}", "online.num_epochs=2", "online.groups_per_epoch=2",
               "online.group_size=4", "trainer.batch_size=2", "sampler.num_inference_steps=4",
               "online.checkpointing_epochs=null", "trainer.cpu=true", "trainer.log_with=none", "eval.enabled=false"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    updates = json.loads((out / "results.json").read_text())["global_step"]
    assert updates == 2  # one update per epoch, each over 2 minibatches x 4 transitions = 8 micro-batches
    for rank in (0, 1):
        counted = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert counted["buckets"] >= 1 and counted["calls"] == updates * counted["buckets"], counted
