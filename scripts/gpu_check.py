"""A GPU check that fits in the minutes a borrowed accelerator lasts (≤ 10 minutes on one CUDA device): the tiny
world's main job, one online recipe phase by phase, and every real-size family at a real resolution with random
weights in bfloat16, each with its images/s, step time and peak memory.

Parts, each in a subprocess of its own with a time limit (a part that fails or runs out of time prints why and the
next one runs):

1. **main job**: ``diffalign-train`` (the README's job, recipe ``tiny_dpo``) on the device; its wall time and its
   phases (``results.json``), its held-out gain;
2. **online**: ``scripts/bench_online.py`` on ``recipe=tiny_flow_grpo`` (1 warm-up + 1 measured epoch): rollout,
   reward, advantages and update, each beside the bare denoiser's floor;
3. **real size**: each family of ``FAMILIES`` (SD1.5 512 px, SDXL 1024 px, SD3.5-Medium 1024 px, Wan2.1-1.3B
   33 × 480 × 832, FLUX.1-dev 1024 px) built from its published configs (``diffalign/configs/arch``, as
   ``scripts/bench_real_size.py``; nothing is downloaded) with random weights in bfloat16 and
   wrapped in the project's policy (``model=<family>``, its LoRA): sampling with diffalign's ``rollout`` (a few
   steps with CFG, decode included) → images/s and seconds per step; one LoRA training step (forward + backward of
   the denoiser on noised latents and an AdamW step) → step time; the peak memory of the part
   (``torch.cuda.max_memory_allocated``; on CPU the process's peak resident set). Random weights make the images
   noise, not the speed: the arithmetic is the real model's. SD3.5 runs without its T5-XXL (``load_t5=false``), Wan
   and FLUX with a one-layer stand-in of their T5 of the real width, as ``bench_real_size.py``.

Published figures are printed beside where a peer published one for the same model and setting (`PUBLISHED`, with
its source); a row without one says so.

    python scripts/gpu_check.py                          # everything on cuda (about 5-8 minutes on one H100/H200)
    python scripts/gpu_check.py --parts real --families sdxl sd35_medium
    python scripts/gpu_check.py --device cpu --tiny --dtype float32 --families sd15   # the path on CPU (a test)
    python scripts/gpu_check.py --json gpu.json          # also every row as JSON

``--tiny`` shrinks every part (the main job to 2 prompts × 2 samples and 3 steps without evaluation, the online
epoch to 2 groups × 4, the real-size families to their smallest valid latents, 1 sampling step, batch 1): it checks
that the script runs, not how fast anything is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
GIB = 1024**3

# family -> published arch file, model config, real size (latent side, or (frames, height px, width px)), the
# smallest valid size (--tiny), sampling steps, CFG, images per sampling batch, training rows
FAMILIES = {
    "sd15": {"arch": "sd15", "model": "sd15", "size": 64, "tiny": 8, "steps": 10, "cfg": 7.5, "batch": 4,
             "train_rows": 4},
    "sdxl": {"arch": "sdxl", "model": "sdxl", "size": 128, "tiny": 8, "steps": 10, "cfg": 5.0, "batch": 1,
             "train_rows": 1},
    "sd35_medium": {"arch": "sd35_medium", "model": "sd35_medium", "size": 128, "tiny": 2, "steps": 10, "cfg": 4.5,
                    "batch": 1, "train_rows": 1, "overrides": ["model.load_t5=false"]},
    "wan21_t2v": {"arch": "wan21_t2v_1_3b", "model": "wan21_t2v", "size": (33, 480, 832), "tiny": (5, 16, 16),
                  "steps": 4, "cfg": 5.0, "batch": 1, "train_rows": 1},
    # FLUX.1-dev (model=flux1_dev): guidance-distilled (the guidance scale is the transformer's input, no CFG batch);
    # its resolution is the model config's height / width, set from the size. A family whose published config is not
    # among the arch configs says so in its row.
    "flux1_dev": {"arch": "flux1_dev", "model": "flux1_dev", "size": 128, "tiny": 2, "steps": 10, "cfg": 3.5,
                  "batch": 1, "train_rows": 1, "size_in_model_config": True},
}

# Figures a peer published for the same model and setting: (family, what) -> (value, unit, pixels, steps, setting,
# source); compared only with a row at the same resolution
PUBLISHED = {
    ("sdxl", "seconds_per_image"): (
        3.31, "s per image", 1024, 30, "SDXL-base 1024 px, 30 steps, batch 1, bf16 + SDPA, diffusers, one A100 80 GB",
        ("diffusers docs, 'Accelerate inference of text-to-image diffusion models' "
         "(huggingface.co/docs/diffusers/tutorials/fast_diffusion): 7.36 s fp32 → 4.63 s bf16 → 3.31 s with SDPA")),
}

MAIN_JOB_TINY = ["data.num_prompts=2", "data.samples_per_prompt=2", "data.sampler.num_inference_steps=3",
                 "trainer.max_steps=3", "trainer.batch_size=2", "eval.enabled=false"]


def _bench_real_size():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import bench_real_size

    return bench_real_size


# ----------------------------------------------------------------------------------------------- real-size child


def peak_bytes(device: str) -> int:
    """The peak memory since the last `reset_peak`: allocated CUDA memory, or the process's peak resident set."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated()
    return _bench_real_size()._status("VmHWM")


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")


@contextlib.contextmanager
def in_memory_pipelines(arch: dict, sample_size, device: str):
    """Within the block, every model family's ``load_pipeline`` (``diffalign.models.*``) returns the pipeline of
    `arch` built in memory with random weights directly on `device` (bfloat16; `bench_real_size.build_components`),
    cast to the requested dtype; the policy's own construction (LoRA, schedulers, checks) runs unchanged. The
    originals are put back on exit."""
    import importlib
    import pkgutil

    import diffusers
    import torch

    import diffalign.models
    from diffalign.models.pipeline_policy import resolve_dtype

    rs = _bench_real_size()
    build_component = rs.build_component

    def load_pipeline(pipeline_class, path, *, torch_dtype="float32", **kwargs):
        rs.build_component = lambda spec, device_=device, **kw: build_component(spec, device=device_)
        try:
            components = rs.build_components(arch, sample_size)
        finally:
            rs.build_component = build_component
        pipe = getattr(diffusers, arch["pipeline"])(**components, **arch.get("pipeline_kwargs", {}))
        return pipe.to(device=torch.device(device), dtype=resolve_dtype(torch_dtype))

    originals = {}
    for info in pkgutil.iter_modules(diffalign.models.__path__):
        module = importlib.import_module(f"diffalign.models.{info.name}")
        if hasattr(module, "load_pipeline"):
            originals[module] = module.load_pipeline
            module.load_pipeline = load_pipeline
    try:
        yield
    finally:
        for module, original in originals.items():
            module.load_pipeline = original


def real_size_child(family: str, device: str, tiny: bool, work: Path, dtype: str = "bfloat16") -> dict:
    """One family in this process: policy from random weights, sampling and one training step; returns its row."""
    import torch

    from diffalign.samplers.ode import PipelineODESampler
    from diffalign.samplers.rollout import rollout

    sys.path.insert(0, str(SCRIPTS))
    from bench_online import compose_config

    spec = FAMILIES[family]
    rs = _bench_real_size()
    arch = rs.load_arch(spec["arch"])
    size = spec["tiny"] if tiny else spec["size"]
    video = isinstance(size, (tuple, list))
    steps, batch, rows = (1, 1, 1) if tiny else (spec["steps"], spec["batch"], spec["train_rows"])
    folder = work / f"{family}_configs"
    sample_size = None if video or spec.get("size_in_model_config") else size  # (the denoiser config's default)
    rs.write_configs(arch, folder, sample_size)
    overrides = [f"model={spec['model']}", f"model.pretrained_model_name_or_path={folder}",
                 f"model.torch_dtype={dtype}", *spec.get("overrides", [])]
    if video:
        overrides += [f"model.num_frames={size[0]}", f"model.height={size[1]}", f"model.width={size[2]}"]
    elif spec.get("size_in_model_config"):
        overrides += [f"model.height={size * 8}", f"model.width={size * 8}"]
    cfg = compose_config(overrides)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    row = {"family": family, "device": device, "dtype": dtype, "size": list(size) if video else size * 8, "steps": steps,
           "batch": batch, "train_rows": rows, "guidance_scale": spec["cfg"]}
    from bench_online import _first_import

    build_policy = _first_import(("diffalign.lora.initial", "build_policy"), ("diffalign.lora.initial", "build_policy"))
    start = time.perf_counter()
    with in_memory_pipelines(arch, sample_size, device):
        policy = build_policy(cfg, log=lambda *a: None)
    policy.to(device)
    sync()
    row["build_s"] = time.perf_counter() - start
    row["denoiser_params"] = sum(p.numel() for n, p in policy.denoiser.named_parameters() if "lora_" not in n)
    prompts = ["a red circle left of a blue square"] * batch
    # sampling: a 1-step warm-up, then `steps` steps with CFG, decode included
    policy.denoiser.eval()
    rollout(policy, prompts, PipelineODESampler(num_inference_steps=1, guidance_scale=spec["cfg"]),
            generator=[torch.Generator().manual_seed(i) for i in range(batch)])
    sync()
    reset_peak(device)
    start = time.perf_counter()
    rollout(policy, prompts, PipelineODESampler(num_inference_steps=steps, guidance_scale=spec["cfg"]),
            generator=[torch.Generator().manual_seed(i) for i in range(batch)])
    sync()
    row["sample_s"] = time.perf_counter() - start
    row["images_per_s"] = batch / row["sample_s"]
    row["seconds_per_step"] = row["sample_s"] / steps
    row["sample_peak"] = peak_bytes(device)
    # one LoRA training step: forward + backward on noised latents at the real size, AdamW on the LoRA
    policy.denoiser.train()
    params = [p for p in policy.denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    probe = rs.probe_latents(policy, "wan21_t2v" if video else family, tuple(size) if video else size, rows)
    embeds = policy.encode_prompts(prompts[:1] * rows, do_classifier_free_guidance=False)
    t = torch.full((rows,), 500.0 if policy.flow_matching else 500, device=device)

    def train_step():
        latents = probe.to(device, policy.dtype)
        with torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16,
                            enabled=dtype == "bfloat16"):
            loss = policy.predict(latents, t, embeds, 1.0).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return float(loss.detach())

    train_step()  # warm-up (allocates Adam's moments)
    reset_peak(device)
    start = time.perf_counter()
    row["loss"] = train_step()
    row["train_step_s"] = time.perf_counter() - start
    row["train_peak"] = peak_bytes(device)
    row["lora_params"] = sum(p.numel() for p in params)
    return row


# ----------------------------------------------------------------------------------------------- parts


def _pythonpath() -> str:
    """The repo first, then whatever ``PYTHONPATH`` already held (on the GPU machine, the carried wheels' folder)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Runs `cmd` with a time limit; (exit code or 124 on timeout, stdout, stderr)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False)
    except subprocess.TimeoutExpired as err:
        return 124, err.stdout if isinstance(err.stdout, str) else "", f"timed out after {timeout:.0f} s"
    return proc.returncode, proc.stdout, proc.stderr


def _tail(text: str) -> str:
    return " | ".join(text.strip().splitlines()[-3:])[:400]


def part_main_job(args, timeout: float) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    from bench_main_job import summarize_job

    out = Path(tempfile.mkdtemp(prefix="gpu-check-main-")) / "run"
    overrides = [f"trainer.cpu={args.device == 'cpu'}"] + (MAIN_JOB_TINY if args.tiny else [])
    code = "import sys; sys.argv = ['diffalign-train'] + sys.argv[1:]; from diffalign.cli import train; train()"
    start = time.perf_counter()
    rc, _, err = run([sys.executable, "-c", code, f"output_dir={out}", "trainer.log_with=none", *overrides], timeout,
                     env=dict(os.environ, PYTHONPATH=_pythonpath(), TQDM_DISABLE="1"))
    wall = time.perf_counter() - start
    if rc != 0:
        return {"part": "main job", "error": f"exit {rc}: {_tail(err)}"}
    info = summarize_job(out, wall)
    shutil.rmtree(out.parent, ignore_errors=True)
    return {"part": "main job", **info}


def part_online(args, timeout: float) -> dict:
    cmd = [sys.executable, str(SCRIPTS / "bench_online.py"), "--child", "tiny_flow_grpo", "--epochs", "1",
           "--warmup", "1", "--floor-repeats", "3", "--device", args.device] + (["--quick"] if args.tiny else [])
    rc, out, err = run(cmd, timeout, env=dict(os.environ, PYTHONPATH=_pythonpath(), TQDM_DISABLE="1"))
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return {"part": "online", "result": json.loads(line[7:])}
    return {"part": "online", "error": f"exit {rc}: {_tail(err or out)}"}


def part_real(family: str, args, timeout: float) -> dict:
    spec = FAMILIES[family]
    if not (_bench_real_size().ARCH_DIR / f"{spec['arch']}.json").is_file():
        arch_dir = _bench_real_size().ARCH_DIR
        return {"family": family, "error": f"{arch_dir.resolve().relative_to(REPO)}/{spec['arch']}.json is missing (its "
                                           "published configs; FLUX comes with branch flux)"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", family, "--device", args.device, "--dtype",
           args.dtype] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, PYTHONPATH=_pythonpath(), TQDM_DISABLE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    deadline = time.time() + timeout
    rc, out, err = run(cmd, timeout, env=env)
    row = _row(out)
    if row is None and args.device.startswith("cuda") and any(f in (err or out) for f in CUDA_FAULTS) and deadline - time.time() > 20:
        # a CUDA error in a fresh process poisons its context: retry once in another with cuDNN attention off
        first = f"exit {rc}: {_tail(err or out)}"
        rc, out, err = run(cmd + ["--no-cudnn-sdp"], deadline - time.time(), env=env)
        row = _row(out)
        if row is not None:
            row["note"] = f"cuDNN attention off: with it on, the child failed ({first[:300]})"
    return row if row is not None else {"family": family, "error": f"exit {rc}: {_tail(err or out)}"}


# what a CUDA kernel failure prints (the cuDNN SDPA backward that failed under FLUX.1-dev at 1024 px on an H200 with
# torch 2.11 + CUDA 13.0 was reported, asynchronously, as a cuBLAS failure of the next kernel; with
# CUDA_LAUNCH_BLOCKING=1, as cuDNN's failed "mha_graph")
CUDA_FAULTS = ("CUDA error", "CUBLAS_STATUS", "mha_graph", "CUDNN_STATUS")


def _row(out: str) -> dict | None:
    for line in out.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return None


# ----------------------------------------------------------------------------------------------- printing


def published_beside(row: dict) -> str:
    """The peer's published figure for `row`'s family (`PUBLISHED`), scaled to the row's steps where the figure is
    per image: "published: ..." or "no published figure"."""
    fig = PUBLISHED.get((row["family"], "seconds_per_image"))
    if fig is None:
        return "no published figure for this setting"
    value, unit, pixels, steps_published, setting, source = fig
    if row["size"] != pixels:
        return f"published {value} {unit} at {pixels} px ({source}); not compared with this row's {row['size']} px"
    per_step = value / steps_published
    ours = row["seconds_per_step"] / row["batch"]
    return (f"published {value} {unit} ({setting}) = {per_step:.3f} s per step; here {ours:.3f} s per step and "
            f"image ({ours / per_step:.2f}x); source: {source}")


def print_real(row: dict) -> None:
    if "error" in row:
        print(f"  {row['family']:<12} not measured: {row['error']}")
        return
    size = "x".join(str(s) for s in row["size"]) if isinstance(row["size"], list) else f"{row['size']} px"
    unit = "videos/s" if isinstance(row["size"], list) else "images/s"
    print(f"  {row['family']:<12} {size:>13}  {row['denoiser_params'] / 1e9:5.2f} B  build {row['build_s']:5.1f} s  "
          f"sampling {row['images_per_s']:7.3f} {unit} ({row['steps']} steps, CFG {row['guidance_scale']}, batch "
          f"{row['batch']}: {row['seconds_per_step']:.3f} s per step), peak {row['sample_peak'] / GIB:5.1f} GiB;  "
          f"train step {row['train_step_s']:.3f} s ({row['train_rows']} rows), peak {row['train_peak'] / GIB:5.1f} "
          f"GiB")
    print(f"  {'':<12} {published_beside(row)}")
    if "note" in row:
        print(f"  {'':<12} {row['note']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the smallest shapes and budgets (a test of the script)")
    p.add_argument("--parts", nargs="+", default=["main", "online", "real"], choices=["main", "online", "real"])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the real-size families' weights (float32 only to test the script on a CPU without bf16 units)")
    p.add_argument("--budget-s", type=float, default=570.0, help="wall seconds for everything (default 9.5 min)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--no-cudnn-sdp", action="store_true",
                   help="turn off cuDNN's scaled-dot-product attention (torch.backends.cuda.enable_cudnn_sdp(False)); "
                        "a family whose child fails with a CUDA error is retried once with it")
    p.add_argument("--child", metavar="FAMILY", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here; run it on the GPU machine, or pass --device cpu "
                "--tiny to test the script")
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.child:
        with tempfile.TemporaryDirectory() as work:
            row = real_size_child(args.child, args.device, args.tiny, Path(work), args.dtype)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    deadline = time.time() + args.budget_s
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    print(f"gpu_check on {args.device}: {name}; torch {torch.__version__}; budget {args.budget_s:.0f} s"
          f"{'; --tiny shapes' if args.tiny else ''}")
    rows = []
    # time limits on a GPU: main job 150 s, online 120 s, then the families share what is left (--tiny, on a CPU:
    # only the budget)
    cap_main, cap_online = (args.budget_s, args.budget_s) if args.tiny else (150.0, 120.0)
    if "main" in args.parts:
        row = part_main_job(args, min(cap_main, deadline - time.time()))
        rows.append(row)
        if "error" in row:
            print(f"main job: not measured: {row['error']}")
        else:
            gain = f"; held-out gain {row['gain'][0]:+.3f} ± {row['gain'][1]:.3f}" if "gain" in row else ""
            print(f"main job: wall {row['wall']:.1f} s = data {row['data']:.1f} + training {row['train']:.1f} "
                  f"({row['steps']} steps) + evaluation {row['eval']:.1f} s{gain}")
    if "online" in args.parts:
        row = part_online(args, min(cap_online, deadline - time.time()))
        rows.append(row)
        if "error" in row:
            print(f"online: not measured: {row['error']}")
        else:
            sys.path.insert(0, str(SCRIPTS))
            from bench_online import print_result

            print_result(row["result"], " (online)")
    if "real" in args.parts:
        print(f"real-size families (random weights, {args.dtype}):")
        families = list(args.families)
        for i, family in enumerate(families):
            left = deadline - time.time()
            if left < 20:
                row = {"family": family, "error": "no time left in --budget-s"}
            else:
                row = part_real(family, args, left / (len(families) - i))
            rows.append(row)
            print_real(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
