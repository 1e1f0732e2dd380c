"""The performance tools of scripts/: the online-loop phase benchmark (``bench_online.py``), the minimal peer loop
(``peer_loop.py``), the GPU check (``gpu_check.py``) and the cost-model sweep (``cost_model.py``). What each asserts is
derived apart from the tool: the peer's step log-probs against diffalign's tested samplers and the Gaussian density by
hand; the phase benchmark's call counts against the recipe's arithmetic (steps × rollout batches, units × updates);
the GPU check's throughput against its own step time; no timing is asserted."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import REPO, load_script

SCRIPTS = REPO / "scripts"


def _script(name: str):
    return load_script(name)


# ----------------------------------------------------------------------------------------------- peer loop


def test_the_peer_loop_imports_no_diffalign_above_its_comparison_harness():
    text = (SCRIPTS / "peer_loop.py").read_text()
    loop = text.split("# ---- the comparison")[0] if "# ---- the comparison" in text else \
        text.split("# -------------------------------------------------------------------------------------------"
                   "---- the comparison")[0]
    assert "the comparison" in text and len(loop) < len(text)
    assert "diffalign" not in "".join(line for line in loop.splitlines() if line.lstrip().startswith(("import",
                                                                                                      "from")))


def test_the_peer_ddim_step_matches_diffalign_and_the_gaussian_by_hand():
    from diffusers import DDIMScheduler

    from diffalign.samplers.ddim_logprob import ddim_step

    peer = _script("peer_loop")
    sched = DDIMScheduler.from_pretrained(REPO / "diffalign" / "assets" / "tiny_sd", subfolder="scheduler")
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x, eps, nxt = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    t = sched.timesteps[4].expand(3)
    _, lp, mean, std = peer.ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=nxt)
    ref = ddim_step(sched, eps, t, x, eta=1.0, prev_sample=nxt)
    torch.testing.assert_close(lp, ref.log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, ref.mean, rtol=1e-5, atol=1e-6)
    # scoring the mean itself: only the normaliser, -log s - log sqrt(2 pi) per element
    _, at_mean, _, _ = peer.ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=mean)
    s = float(std.flatten()[0])
    torch.testing.assert_close(at_mean, torch.full((3,), -math.log(s) - 0.5 * math.log(2 * math.pi)))


def test_the_peer_sde_step_matches_diffalign_flow_sde():
    from diffalign.samplers.flow_sde import flow_sde_step

    peer = _script("peer_loop")
    g = torch.Generator().manual_seed(1)
    x, v, nxt = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.8, 0.8]), torch.tensor([0.6, 0.6])
    _, lp, mean, _ = peer.sde_step_with_logprob(sigma, sigma_next, 0.95, v, x, 0.7, prev_sample=nxt)
    ref = flow_sde_step(v, sigma, sigma_next, x, noise_level=0.7, sigma_max=0.95, prev_sample=nxt)
    torch.testing.assert_close(lp, ref.log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, ref.mean)


def test_the_peer_tracker_normalises_per_prompt_by_hand():
    peer = _script("peer_loop")
    tracker = peer.PerPromptStatTracker(None, 0, 1e-4)
    out = tracker.update(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 0.0, 4.0]))
    # a: mean 2, population std 1; b: mean 2, std 2
    torch.testing.assert_close(out, torch.tensor([-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001]))


@pytest.mark.parametrize("method", ["flow_grpo", "ddpo"])
def test_a_peer_epoch_is_on_policy_at_its_first_unit_and_moves_the_lora(method, monkeypatch):
    """Before the update, the log-prob recomputed with gradients equals the stored one (ratio 1: sampling and
    training take the same path), and the epoch's one optimizer step changes the LoRA."""
    peer = _script("peer_loop")
    cfg = peer.quick(peer.PEERS[method])
    loop = peer.PeerLoop(cfg, ["a red circle", "a blue square"], peer.brightness)
    seen = []
    recompute = loop.log_prob

    def spy(sample, rows, k, cond, sched):
        lp, mean, std = recompute(sample, rows, k, cond, sched)
        if torch.is_grad_enabled():
            seen.append((lp.detach() - sample["log_probs"][rows, k]).abs().max())
        return lp, mean, std

    monkeypatch.setattr(loop, "log_prob", spy)
    before = [p.detach().clone() for p in loop.params]
    logs = loop.run_epoch()
    assert logs["units"] == (cfg.groups_per_epoch * cfg.group_size // cfg.batch_size) * max(
        1, int(cfg.num_inference_steps * cfg.timestep_fraction))
    assert float(seen[0]) < 1e-4
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, loop.params))
    assert 0.0 <= logs["reward"] <= 1.0


# ----------------------------------------------------------------------------------------------- bench_online


def test_bench_online_counts_the_denoiser_calls_of_each_phase_and_leaves_the_run_unchanged():
    """Flow-GRPO, 2 prompts x 4 samples, 4 SDE steps, rollout batch 8 (one batch), training batch 8: the rollout calls
    the denoiser 4 times on 2 x 8 guided rows; the update has 1 minibatch x int(4 x 0.99) = 3 transitions, each a
    guided forward+backward and a reference forward (beta_KL > 0)."""
    bench = _script("bench_online")
    overrides = bench.recipe_overrides("tiny_flow_grpo", True, [])
    result = bench.measure("tiny_flow_grpo", overrides, warmup=0, epochs=2, floor_repeats=1)
    epoch = result["epochs"][1]
    calls = epoch["calls"]
    assert sum(calls["rollout"].values()) == 4
    assert all(s.startswith("fwd [(16, 4, 8, 8)") for s in calls["rollout"])
    grad = {s: n for s, n in calls["update"].items() if s.startswith("fwd+bwd")}
    nograd = {s: n for s, n in calls["update"].items() if s.startswith("fwd ")}
    assert sum(grad.values()) == 3 and sum(nograd.values()) == 3
    for phase in ("rollout", "update"):
        assert epoch["floors"][phase] == pytest.approx(sum(n * epoch["per_call"][s] for s, n in calls[phase].items()))
        assert epoch["seconds"][phase] > 0
    assert set(epoch["seconds"]) >= {"rollout", "reward", "advantages", "update"}
    # the second rollout floor: one batch's prompts encoded (8 rows, with the negatives for CFG) and its 8 latents
    # decoded, each replayed once, on top of the bare forwards
    assert epoch["side_calls"] == {"encode_prompts [8, None] [('do_classifier_free_guidance', True)]": 1,
                                   "decode [(8, 4, 8, 8)] []": 1}
    side = sum(epoch["side_per_call"].values())
    assert epoch["rollout_floor_with_text_vae"] == pytest.approx(epoch["floors"]["rollout"] + side)
    assert side > 0
    # the third rollout floor: the same 4 forwards with the LoRA branch on; the branch's FLOPs: every adapted layer of
    # the tiny SD3-format model is a square 96 x 96 attention projection (3 heads x 32) with rank 8, so
    # r (d_in + d_out) / (d_in d_out) = 2 r / d = 16 / 96; counted over the whole forward it is diluted (attention
    # scores, the unadapted layers) but not zero
    assert epoch["rollout_floor_adapted"] > 0
    assert result["lora_flops"]["formula"] == pytest.approx(16 / 96)
    assert 0 < result["lora_flops"]["counted"] < 16 / 96
    assert result["work"]["stochastic"] and result["work"]["fuse_rollout_lora"] == "auto"

    # the same two epochs without the benchmark (no timers, hook or floor replays): the same LoRA, bit for bit
    import tempfile

    from diffalign.train import online as loop

    assert loop._updates.__module__ == "diffalign.train.online"  # the timers were taken off again
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench.compose_config([*overrides, f"output_dir={tmp}"])
        run = bench.setup_run(loop, cfg)
        run.warnings = bench.warning_counts()
        for _ in range(2):
            loop._epoch(run)
            run.epoch += 1
        assert bench.lora_digest(run.policy) == result["lora_sha256"]


# ----------------------------------------------------------------------------------------------- cost model


def test_cost_model_moves_one_factor_at_a_time_three_points_each():
    cost = _script("cost_model")
    pts = cost.points({"groups_per_epoch": 8, "num_inference_steps": 20, "latent_side": 8})
    assert len(pts) == 7 and pts[0][0] == "base"
    for axis, values in (("groups_per_epoch", {4, 8, 16}), ("num_inference_steps", {10, 20, 40}),
                         ("latent_side", {8, 16, 32})):
        on_axis = [p for a, p in pts if a in (axis, "base")]
        assert {p[axis] for p in on_axis} == values
        others = [k for k in pts[0][1] if k != axis]
        assert all(p[k] == pts[0][1][k] for p in on_axis for k in others)


def test_the_reference_pool_stores_k_float32_copies_of_the_lora():
    """K snapshots of the tiny SD's rank-8 LoRA on to_q/k/v/out: K x 4 bytes x r x sum(in + out) over the adapted
    layers, counted from the UNet's Linear shapes."""
    from diffalign.models.stable_diffusion import StableDiffusionPolicy

    policy = StableDiffusionPolicy.from_pretrained(_script("bench_online").asset_path("tiny_sd"), lora_rank=8)
    by_hand = 0
    for name, module in policy.denoiser.named_modules():
        if name.endswith(("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                          "attn2.to_v", "attn2.to_out.0")) and hasattr(module, "base_layer"):
            by_hand += 8 * (module.base_layer.in_features + module.base_layer.out_features)
    rows = _script("cost_model").pool_memory(ks=(1, 3))
    assert [r["stored_bytes"] for r in rows] == [4 * by_hand, 3 * 4 * by_hand]
    assert [r["snapshots"] for r in rows] == [1, 3]


# ----------------------------------------------------------------------------------------------- GPU check


def test_the_gpu_check_prints_the_published_figure_per_step_beside_its_own():
    gpu = _script("gpu_check")
    row = {"family": "sdxl", "seconds_per_step": 0.2, "batch": 2, "size": 1024}
    text = gpu.published_beside(row)
    # 3.31 s for 30 steps of one image = 0.110 s per step; here 0.2 s per step for 2 images = 0.100 s per image-step
    assert "0.110 s per step" in text and "0.100 s per step and image" in text and "(0.91x)" in text
    assert "fast_diffusion" in text
    assert "not compared" in gpu.published_beside({**row, "size": 64})  # --tiny: another resolution
    assert gpu.published_beside({"family": "sd15", "seconds_per_step": 1.0, "batch": 1, "size": 512}).startswith(
        "no published")


def test_the_gpu_check_refuses_cuda_without_a_device_in_one_line(capsys):
    gpu = _script("gpu_check")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cuda"])
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_a_family_without_its_published_config_says_so(monkeypatch):
    gpu = _script("gpu_check")
    monkeypatch.setitem(gpu.FAMILIES, "not_there", {**gpu.FAMILIES["sd15"], "arch": "not_there"})
    row = gpu.part_real("not_there", None, 1.0)
    assert row["error"].startswith("diffalign/configs/arch/not_there.json is missing")


def test_every_family_has_its_published_config_and_model_config():
    gpu = _script("gpu_check")
    arch_dir = gpu._bench_real_size().ARCH_DIR
    for family, spec in gpu.FAMILIES.items():
        assert (arch_dir / f"{spec['arch']}.json").is_file(), family
        assert (REPO / "diffalign" / "configs" / "model" / f"{spec['model']}.yaml").is_file(), family


def test_a_family_whose_child_hits_a_cuda_fault_is_retried_once_with_cudnn_attention_off(monkeypatch):
    """On the H200 the FLUX.1-dev child failed in cuDNN's attention backward (reported as a cuBLAS failure of the next
    kernel); a CUDA fault poisons the process, so the check retries once in a new child with ``--no-cudnn-sdp`` and
    notes it. Another failure, or one on a CPU, is not retried."""
    import argparse
    import json

    gpu = _script("gpu_check")
    calls = []
    fault = "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"

    def fake_run(cmd, timeout, env=None):
        calls.append(cmd)
        if "--no-cudnn-sdp" in cmd:
            return 0, "ROW " + json.dumps({"family": "flux1_dev", "train_step_s": 0.5}), ""
        return 1, "", fault

    monkeypatch.setattr(gpu, "run", fake_run)
    args = argparse.Namespace(device="cuda", dtype="bfloat16", tiny=False)
    row = gpu.part_real("flux1_dev", args, 300.0)
    assert len(calls) == 2 and "--no-cudnn-sdp" not in calls[0] and calls[1][-1] == "--no-cudnn-sdp"
    assert row["train_step_s"] == 0.5 and row["note"].startswith("cuDNN attention off") and "CUBLAS" in row["note"]
    calls.clear()
    row = gpu.part_real("flux1_dev", argparse.Namespace(device="cpu", dtype="float32", tiny=True), 300.0)
    assert len(calls) == 1 and row["error"].startswith("exit 1:")
    calls.clear()
    monkeypatch.setattr(gpu, "run", lambda cmd, timeout, env=None: (calls.append(cmd), (1, "", "ValueError: x"))[1])
    assert gpu.part_real("flux1_dev", args, 300.0)["error"] == "exit 1: ValueError: x" and len(calls) == 1


def test_the_gpu_check_children_keep_the_callers_pythonpath(monkeypatch):
    """On the GPU machine the wheels the image lacks are on PYTHONPATH: the children put the repo first and keep it."""
    import os

    gpu = _script("gpu_check")
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert gpu._pythonpath().split(os.pathsep) == [str(REPO), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu._pythonpath() == str(REPO)


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_on_cpu_at_tiny_shapes(tmp_path):
    """The whole path at the smallest shapes on CPU (float32: bf16 matmuls are slow on CPUs without bf16 units): the
    main job, the online epoch and SD1.5 built from its published config. Its throughput is its own batch over its
    sampling time; the held-out gain is absent (no evaluation at --tiny)."""
    import json

    gpu = _script("gpu_check")
    out = tmp_path / "rows.json"
    assert gpu.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--families", "sd15", "--budget-s", "1800",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    main_job, online, sd15 = rows
    assert "error" not in main_job and main_job["steps"] == 3
    assert "error" not in online and sum(online["result"]["epochs"][0]["calls"]["rollout"].values()) == 4
    assert "error" not in sd15, sd15
    assert sd15["size"] == 64 and sd15["denoiser_params"] == 859_520_964  # SD1.5's UNet, as published
    assert sd15["images_per_s"] == pytest.approx(sd15["batch"] / sd15["sample_s"])
    assert sd15["train_step_s"] > 0 and sd15["train_peak"] > 0


def _tiny_sd_arch(rs) -> dict:
    """An arch entry (the ``configs/arch`` format) holding the shipped tiny SD's configs: random weights of the tiny
    world's shapes, so the real-size path runs in seconds."""
    import json

    assets = REPO / "diffalign" / "assets" / "tiny_sd"

    def config(part):
        return {k: v for k, v in json.loads((assets / part / "config.json").read_text()).items()
                if not k.startswith("_") and k not in ("architectures", "transformers_version", "dtype")}

    text = config("text_encoder")
    text["vocab_size"] = len(rs.stand_in_tokenizer(text["max_position_embeddings"]))
    scheduler = {k: v for k, v in json.loads((assets / "scheduler" / "scheduler_config.json").read_text()).items()
                 if not k.startswith("_")}
    return {"pipeline": "StableDiffusionPipeline", "denoiser": "unet",
            "pipeline_kwargs": {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False},
            "components": {
                "unet": {"library": "diffusers", "class": "UNet2DConditionModel", "config": config("unet")},
                "vae": {"library": "diffusers", "class": "AutoencoderKL", "config": config("vae")},
                "text_encoder": {"library": "transformers", "class": "CLIPTextModel", "config": text},
                "scheduler": {"library": "diffusers", "class": "DDIMScheduler", "config": scheduler},
                "tokenizer": {"library": "stand-in", "model_max_length": text["max_position_embeddings"]}}}


def test_the_real_size_path_runs_on_cpu_with_a_tiny_arch(monkeypatch, tmp_path):
    """`real_size_child` end to end (in-memory random weights, the project's policy, sampling, one LoRA step) on an
    arch of the tiny SD's shapes: the UNet built from the config has the shipped tiny UNet's parameter count, the
    throughput is the batch over the sampling time, the step trains the LoRA only."""
    from diffusers import UNet2DConditionModel

    gpu = _script("gpu_check")
    rs = gpu._bench_real_size()
    arch = _tiny_sd_arch(rs)
    load_arch = rs.load_arch
    monkeypatch.setattr(rs, "load_arch", lambda name: arch if name == "tiny_test" else load_arch(name))
    monkeypatch.setitem(gpu.FAMILIES, "tiny_test", {"arch": "tiny_test", "model": "tiny_sd", "size": 8, "tiny": 8,
                                                    "steps": 2, "cfg": 4.0, "batch": 2, "train_rows": 2})
    row = gpu.real_size_child("tiny_test", "cpu", False, tmp_path, dtype="float32")
    shipped = UNet2DConditionModel.from_pretrained(REPO / "diffalign" / "assets" / "tiny_sd", subfolder="unet")
    assert row["denoiser_params"] == sum(p.numel() for p in shipped.parameters())
    assert row["steps"] == 2 and row["batch"] == 2
    assert row["images_per_s"] == pytest.approx(2 / row["sample_s"])
    assert row["seconds_per_step"] == pytest.approx(row["sample_s"] / 2)
    assert row["lora_params"] > 0 and math.isfinite(row["loss"]) and row["train_step_s"] > 0


@pytest.mark.parametrize("method", ["flow_grpo", "ddpo"])
def test_the_peer_trains_an_adapter_of_the_same_size_as_diffalign(method, tmp_path):
    peer = _script("peer_loop")
    cfg = peer.quick(peer.PEERS[method])
    ours = peer.diffalign_run(method, cfg, tmp_path)
    loop = peer.PeerLoop(cfg, ["a red circle"], peer.brightness)
    assert sum(p.numel() for p in loop.params) == ours.trainable > 0


# ----------------------------------------------------------------------------------------------- bench_shared_machine


def test_the_shared_machine_candidates_reach_the_start_up_choice_as_labelled(monkeypatch):
    """``default`` is today's behaviour (libgomp's own spin count made explicit keeps the start-up choice out, even
    beside a busy process), ``adaptive`` leaves the choice to diffalign (PASSIVE beside one, nothing when idle), and
    no OpenMP variable of the caller leaks into a job's environment."""
    from diffalign.runtime.openmp import shared_machine_defaults

    bench = _script("bench_shared_machine")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # (the test suite's own setting must not reach the jobs)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    quiet = {"torch_loaded": False, "announce": lambda _: None}
    env = bench.clean_env(bench.CANDIDATES["default"])
    assert "OMP_NUM_THREADS" not in env and "OMP_WAIT_POLICY" not in env and env["GOMP_SPINCOUNT"] == "300000"
    assert shared_machine_defaults(env, probe=lambda: 2.0, **quiet) == {}
    assert shared_machine_defaults(bench.clean_env(bench.CANDIDATES["adaptive"]), probe=lambda: 2.0, **quiet) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    assert shared_machine_defaults(bench.clean_env(bench.CANDIDATES["adaptive"]), probe=lambda: 0.0, **quiet) == {}
    assert bench.clean_env(bench.CANDIDATES["threads-1"])["OMP_NUM_THREADS"] == "1"


@pytest.mark.slow
def test_bench_shared_machine_runs_idle_and_beside_a_competitor(tmp_path):
    """The whole tool at tiny sizes, one workload, two candidates: every run finishes (or is capped), and the
    adaptive run beside the competitor (which keeps both cores busy) chose PASSIVE; no timing asserted."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = tmp_path / "shared.json"
    subprocess.run([sys.executable, str(SCRIPTS / "bench_shared_machine.py"), "--quick", "--workloads", "online",
                    "--candidates", "default", "adaptive", "--cap", "50", "--json", str(out)], check=True, env=env,
                   timeout=900, capture_output=True)
    runs = json.loads(out.read_text())["online"]
    assert set(runs) == {"default", "adaptive"}
    assert [r["adapted"] for r in runs["default"]["contended"]] == [False]
    assert [r["adapted"] for r in runs["adaptive"]["contended"]] == [True]
    assert all("train_seconds" in r["phases"] for c in runs.values() for r in c["idle"] + c["contended"])


# ----------------------------------------------------------------------------------------------- profile_rollout


def test_profile_rollout_replays_the_epochs_rollout_and_splits_its_time():
    """Flow-GRPO, 2 prompts x 4 samples, 2 SDE steps, one rollout batch of 8 rows: the replayed rollout calls the
    denoiser twice on 16 guided rows; after one epoch the LoRA is trained, so the fused replay fuses it."""
    prof = _script("profile_rollout")
    p = prof.profile("tiny_flow_grpo", 1, ["online.groups_per_epoch=2", "online.group_size=4",
                                           "online.rollout_batch_size=8", "trainer.batch_size=8",
                                           "sampler.num_inference_steps=2"])
    assert p["rows"] == 8 and len(p["rollouts"]) == 1
    [(shapes, call)] = p["per_call"].items()
    assert shapes.startswith("[(16, 4, 8, 8)") and call["n"] == 2 and call["lora_context"] == "fused"
    assert p["replay"]["bare"] == pytest.approx(2 * call["bare"])
    assert set(p["split"]) == set(prof.PARTS)
    assert all(p["split"][k] > 0 for k in ("denoiser", "step", "prompts", "decode"))
    assert p["split"]["denoiser"] < p["rollout"]
