"""FSDP (issue 19 item 8): both loops on 2 CPU processes over gloo with ``configs/accelerate/fsdp.yaml``, compared with
one process on the same global batch; checkpoints in the one-process layout, resumed across process counts.

Launch: ``accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 2 <script> ...
trainer.cpu=true`` (accelerate 1.15 turns FSDP off on CPU; `diffalign.runtime.distributed` switches it back on)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, compose_cfg
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # each launch starts two processes (≈ 25-35 s on 2 shared cores)

FSDP_CONFIG = REPO / "configs" / "accelerate" / "fsdp.yaml"
QUIET = ["trainer.log_with=none", "eval.enabled=false"]
# updates proportional to the gradient (Adam eps 1, as tests/integration/test_multiprocess.py), clipped to a norm
# of 1e-6 (far below the gradient's), so every update is lr × the clipped gradient: a clip by each shard's own norm
# (what accelerator.clip_grad_norm_ does with only the LoRA parameters) would scale the shards differently
DPO = ["model=tiny_random", "data=shapes_pairs", "data.num_pairs=16", "trainer.max_steps=2",
       "trainer.checkpointing_steps=1", "trainer.keep_last=-1", "trainer.optimizer.lr=1000.0",
       "trainer.lr_warmup_steps=0", "trainer.optimizer.eps=1.0", "trainer.max_grad_norm=1e-6"]
MAIN_PROCESS_SAMPLING = ["monitor.every=1", "monitor.num_prompts=2", "monitor.seeds=[0,1]",
                         "monitor.sampler.num_inference_steps=2",
                         "eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=2"]
GRPO = ["model=tiny_random", "method=flow_grpo", "sampler=ddim", "online.num_epochs=2", "online.groups_per_epoch=2",
        "online.group_size=4", "online.checkpointing_epochs=1", "online.updates_per_epoch=2", "trainer.keep_last=-1",
        "sampler.num_inference_steps=4", "trainer.optimizer.lr=10.0", "trainer.lr_warmup_steps=0",
        "trainer.optimizer.eps=1.0", "trainer.max_grad_norm=null"]


def launch_fsdp(args: list[str], cwd: Path, quiet: tuple = tuple(QUIET)) -> subprocess.CompletedProcess:
    """``diffalign-train <args>`` on 2 CPU processes under FSDP (with `quiet`: no trackers, no evaluation)."""
    script = cwd / "train.py"
    script.write_text("import sys\nfrom diffalign.cli import train\nsys.argv[0] = 'diffalign-train'\ntrain()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
               "--num_processes", "2", "--main_process_port", str(port), str(script), *args, "trainer.cpu=true",
               *quiet]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400, check=False)


def one_process(loop: str, args: list[str]) -> None:
    from importlib import import_module

    import_module(f"diffalign.train.{loop}").train(compose_cfg([*args, *QUIET]))


def lora(run: Path, folder: str = "final") -> dict[str, torch.Tensor]:
    return load_file(run / folder / "pytorch_lora_weights.safetensors")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def moments(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The Adam moments of a checkpoint, keyed ``<param id>.<exp_avg|exp_avg_sq>`` (the one-process layout)."""
    from diffalign.runtime.checkpoint import read_state

    state = read_state(run / f"checkpoint-{step}", "optimizer")["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The launches the tests share: DPO under FSDP (2 × batch 2) and on one process (batch 4); an FSDP resume and a
    one-process resume of the FSDP run's checkpoint-1; Flow-GRPO under FSDP (1 group each) and on one process."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {name: root / name for name in ("dpo_fsdp", "dpo_one", "resume_fsdp", "resume_one", "grpo_fsdp", "grpo_one")}
    logs = {}
    logs["dpo_fsdp"] = launch_fsdp([f"output_dir={out['dpo_fsdp']}", "trainer.batch_size=2", *DPO], root)
    assert logs["dpo_fsdp"].returncode == 0, logs["dpo_fsdp"].stderr[-3000:]
    one_process("preference", [f"output_dir={out['dpo_one']}", "trainer.batch_size=4", *DPO])
    ckpt1 = out["dpo_fsdp"] / "checkpoint-1"
    # (with the monitors and the final evaluation: main-process sampling on the gathered weights)
    logs["resume_fsdp"] = launch_fsdp([f"output_dir={out['resume_fsdp']}", f"resume={ckpt1}", "trainer.batch_size=2",
                                       *DPO, *MAIN_PROCESS_SAMPLING], root, quiet=("trainer.log_with=none",))
    assert logs["resume_fsdp"].returncode == 0, logs["resume_fsdp"].stderr[-3000:]
    one_process("preference", [f"output_dir={out['resume_one']}", f"resume={ckpt1}", "trainer.batch_size=4", *DPO])
    logs["grpo_fsdp"] = launch_fsdp([f"output_dir={out['grpo_fsdp']}", "trainer.batch_size=2", *GRPO], root)
    assert logs["grpo_fsdp"].returncode == 0, logs["grpo_fsdp"].stderr[-3000:]
    one_process("online", [f"output_dir={out['grpo_one']}", "trainer.batch_size=4", *GRPO])
    return {**out, "logs": logs}


def test_fsdp_is_switched_on_and_said(runs):
    """accelerate 1.15 drops FSDP with trainer.cpu=true without a word; the run switches it on and says so once."""
    said = [line for line in runs["logs"]["dpo_fsdp"].stdout.splitlines() if "FSDP on CPU" in line]
    assert len(said) == 1 and "switched back on (FULL_SHARD, use_orig_params=True, gloo, 2 processes)" in said[0]
    assert "× 4 pairs (batch 2 × accumulation 1 × 2 processes)" in runs["logs"]["dpo_fsdp"].stdout


def test_fsdp_dpo_matches_one_process(runs):
    """Diffusion-DPO, same global batch and per-sample draws, every update clipped (max_grad_norm 1e-6; FSDP's norm
    over both shards): the final LoRA and the Adam moments of checkpoint-2 (gathered into the one-process layout)
    agree with the one-process run's within float rounding, 1e-3 of the size of the change
    (docs/guides/reliability.md)."""
    moved = max(float(v.abs().max()) for k, v in lora(runs["dpo_one"]).items() if "lora_B" in k or "lora.up" in k)
    assert moved > 1e-5
    assert max_difference(lora(runs["dpo_fsdp"]), lora(runs["dpo_one"])) < 1e-3 * moved
    fsdp, one = moments(runs["dpo_fsdp"], 2), moments(runs["dpo_one"], 2)
    assert set(fsdp) == set(one) and len(fsdp) > 0
    assert max_difference(fsdp, one) < 1e-3 * max(float(v.abs().max()) for v in one.values())


def test_gathered_optimizer_state_keeps_both_moments(runs):
    """torch 2.14 on CPU: FSDP's optimizer-state gather with offload_to_cpu=True returned exp_avg_sq equal to exp_avg.
    The checkpoint's second moment is the square average, not a copy of the first: for Adam after 2 steps
    exp_avg_sq ≥ 0 everywhere and differs from exp_avg (whose entries take both signs)."""
    state = moments(runs["dpo_fsdp"], 2)
    for key in [k for k in state if k.endswith(".exp_avg")]:
        m, v = state[key], state[key + "_sq"]
        assert (v >= 0).all()
        assert not torch.equal(m, v), key


def test_fsdp_resume_is_exact_and_crosses_process_counts(runs):
    """checkpoint-1 of the FSDP run resumed under FSDP gives its final LoRA bit for bit; resumed on one process (the
    checkpoint is in the one-process layout) it agrees within float rounding."""
    final = lora(runs["dpo_fsdp"])
    assert max_difference(lora(runs["resume_fsdp"]), final) == 0.0
    moved = max(float(v.abs().max()) for k, v in final.items() if "lora_B" in k or "lora.up" in k)
    assert max_difference(lora(runs["resume_one"]), final) < 1e-3 * moved
    resumed = json.loads((runs["resume_fsdp"] / "results.json").read_text())
    assert resumed["global_step"] == 2


def test_fsdp_monitors_and_evaluation_sample_on_the_main_process(runs):
    """The resumed FSDP run had the monitors (every step) and the final evaluation on: both sample on the main process
    inside `full_weights` while the other waits; the run finishes with the report (the evaluation's weights hashes
    used to leave the gathered storage unfreeable: "Trying to resize storage that is not resizable")."""
    out = runs["logs"]["resume_fsdp"].stdout + runs["logs"]["resume_fsdp"].stderr
    assert out.count("[diffalign] monitor step 2:") == 1
    resumed = json.loads((runs["resume_fsdp"] / "results.json").read_text())
    assert set(resumed["eval"]["variants"]) == {"base", "finetuned"}
    assert (runs["resume_fsdp"] / "eval" / "report.html").is_file()


def test_fsdp_flow_grpo_matches_one_process(runs):
    """Flow-GRPO (2 epochs × 2 updates, groups split over the processes, stratified minibatches): same LoRA and Adam
    moments as one process within float rounding."""
    history = [json.loads(line) for line in (runs["grpo_fsdp"] / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history] == [1, 2] and history[-1]["rollouts"] == 16
    assert max_difference(lora(runs["grpo_fsdp"]), lora(runs["grpo_one"])) < 1e-4
    assert max_difference(moments(runs["grpo_fsdp"], 4), moments(runs["grpo_one"], 4)) < 1e-6


def test_fsdp_refuses_what_it_does_not_shard(tmp_path):
    """A reference strategy that snapshots the LoRA is refused during validation (before the model loads), naming
    the setting and the fix; so is a method that keeps its own copies of the weights."""
    from diffalign.runtime.distributed import check_launch

    def cfg(*overrides):
        return compose_cfg(["model=tiny_random", "trainer.cpu=true", *overrides])

    res = launch_fsdp([f"output_dir={tmp_path / 'run'}", "reference=ema", "trainer.batch_size=2", *DPO], tmp_path)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("diffalign: error:")]
    assert errors and "reference=ema under FSDP" in errors[0] and "reference=frozen_base" in errors[0], res.stderr
    assert "Traceback" not in res.stderr.split("diffalign: error:")[0]
    fsdp = {"ACCELERATE_USE_FSDP": "true"}
    check_launch(cfg(*DPO), fsdp)  # Diffusion-DPO with the frozen base: accepted
    check_launch(cfg(*GRPO), fsdp)
    with pytest.raises(ValueError, match="method=dgpo under FSDP: DGPO keeps its own copies of the weights "
                                         r"\(old_policy_state\).*configs/accelerate/ddp.yaml"):
        check_launch(cfg("method=dgpo", "sampler=dpm_ode"), fsdp)


def test_a_deepspeed_launch_is_refused_before_any_model_loads(tmp_path):
    """``accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml`` sets ACCELERATE_USE_DEEPSPEED; the
    run stops during validation (no run folder content, no traceback) with the three causes and the fix."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "ACCELERATE_USE_DEEPSPEED": "true"}
    code = "import sys; from diffalign.cli import train; sys.argv = ['diffalign-train'] + sys.argv[1:]; train()"
    res = subprocess.run([sys.executable, "-c", code, f"output_dir={tmp_path / 'run'}", "model=tiny_random",
                          "trainer.cpu=true", *QUIET], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    message = res.stderr.strip().splitlines()[-1]
    assert message.startswith("diffalign: error: a DeepSpeed launch")
    for cause in ("train_micro_batch_size_per_gpu", "inside backward()", "drops DeepSpeed", "configs/accelerate/fsdp.yaml"):
        assert cause in message
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "logs").exists()


def test_accelerate_drops_deepspeed_on_cpu_as_the_refusal_says():
    """Cause (3) of the refusal, checked against accelerate itself: with cpu=True an ACCELERATE_USE_DEEPSPEED launch
    gets no DeepSpeed state (accelerate 1.15 ``AcceleratorState``: ``elif ACCELERATE_USE_DEEPSPEED and not cpu``)."""
    code = ("import os; os.environ.update(ACCELERATE_USE_DEEPSPEED='true');\n"
            "from accelerate.state import AcceleratorState, PartialState\n"
            "from accelerate.utils import TorchDynamoPlugin\n"
            "PartialState(cpu=True)\n"
            "state = AcceleratorState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)\n"
            "print(state.distributed_type)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "DistributedType.NO"
