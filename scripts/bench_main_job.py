"""Benchmark of the README's main job (`diffalign-train` with no overrides), phase by phase, against the denoiser's floor.

For each phase of the job (on-policy data, training, evaluation) it prints the wall time from the run's
``results.json`` next to the *floor*: the time the bare denoiser (the UNet alone, no LoRA branch, no sampler, VAE, text
encoder or reward) needs for the same forward passes (and, for training, forward + backward passes) at the same batch
size, measured in this process right after the job, so a phase's ratio to its floor is taken on the same machine in
the same minute. It also times diffalign's sampling loop alone (`rollout`, 20 DDIM steps with classifier-free
guidance) against its floor, and prints the thread settings the figures were measured under.

    python scripts/bench_main_job.py                    # the main job once, then the floors and sampling
    python scripts/bench_main_job.py --skip-job         # floors and sampling only
    python scripts/bench_main_job.py --compare e5cbf18  # the main job of commit e5cbf18 and of this checkout,
                                                        # alternately (--repeats each), and their ratio
    python scripts/bench_main_job.py --device cuda --dtype float16 --skip-job   # the same floors on a GPU

Floors (B = a phase's images per sampling batch; CFG runs the UNet on 2B rows):
- data and evaluation: ``images / B × steps × t_fwd(2B)``;
- training (Diffusion-DPO, B pairs per step): ``steps × (t_fwd+bwd(2B) + t_fwd(2B))``: the policy's forward and
  backward on winners and losers (with its LoRA, the trained part) plus the reference's forward.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = dict(os.environ)  # the jobs get the caller's environment, not settings this script's imports make


def thread_settings() -> str:
    import torch

    env = {k: CHILD_ENV[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS") if k in CHILD_ENV}
    return (f"torch {torch.__version__}: {torch.get_num_threads()} intra-op / {torch.get_num_interop_threads()} "
            f"inter-op threads, {os.cpu_count()} CPUs; job environment {env or '(no OpenMP variables set)'}")


def shadow_metadata(tree: Path) -> Path:
    """A folder with a ``diffalign`` dist-info whose entry points are those of `tree`'s pyproject.toml: put before
    site-packages on the path, it shadows the installed checkout's metadata (`importlib.metadata` keeps the first
    distribution of a name), so another commit's run does not load reward plugins that commit does not have."""
    import tomllib

    project = tomllib.loads((tree / "pyproject.toml").read_text())["project"]
    folder = Path(tempfile.mkdtemp(prefix="diffalign-meta-"))
    info = folder / f"diffalign-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: diffalign\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items()) + "\n"
        for group, entries in groups.items()))
    return folder


def run_job(source: Path, out: Path, overrides: list[str], metadata: Path | None = None) -> float:
    """Runs `diffalign-train` from the package under `source` (a checkout or a worktree) into `out`; wall seconds."""
    path = [str(source)] + ([str(metadata)] if metadata is not None else [])
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join(path))
    code = ("import sys; sys.argv = ['diffalign-train'] + sys.argv[1:]; from diffalign.cli import train; train()")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, f"output_dir={out}", "trainer.log_with=none", *overrides],
                   check=True, env=env, cwd=source, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def summarize_job(out: Path, wall: float) -> dict:
    res = json.loads((out / "results.json").read_text())
    info = {"wall": wall, "total": res["total_seconds"], "data": res.get("data_seconds", 0.0),
            "train": res["train_seconds"], "eval": res.get("eval_seconds", 0.0), "steps": res["global_step"]}
    ev = res.get("eval", {})
    gain = ev.get("finetuned_vs_base", {}).get("geneval_shapes/accuracy_gain")
    if gain:
        info["gain"] = (gain["gain"], gain["se"])
    info["accuracy"] = {k: v.get("geneval_shapes/accuracy") for k, v in ev.get("variants", {}).items()}
    info["eval_images"] = sum(v.get("num_images", 0) for v in ev.get("variants", {}).values())
    return info


def print_job(label: str, info: dict) -> None:
    print(f"{label}: wall {info['wall']:.1f} s (process start to exit); inside the job {info['total']:.1f} s = "
          f"data {info['data']:.1f} + training {info['train']:.1f} ({info['steps']} steps) + evaluation "
          f"{info['eval']:.1f} + setup {info['total'] - info['data'] - info['train'] - info['eval']:.1f}")
    if "gain" in info:
        g, se = info["gain"]
        acc = ", ".join(f"{k} {v:.3f}" for k, v in info["accuracy"].items())
        print(f"    held-out accuracy {acc}; gain {g:+.3f} ± {se:.3f} ({g / se:.1f} s.e.)")


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def denoiser_floors(batches: list[int], train_batch: int | None, repeats: int, device: str, dtype: str) -> dict:
    """Seconds per bare-UNet forward at each UNet batch in `batches` (no grad, adapter off), and per forward+backward
    at `train_batch` rows with the main job's LoRA (conv + attention, rank 8) trained."""
    import torch

    from diffalign.config.compose import asset_path
    from diffalign.models.stable_diffusion import StableDiffusionPolicy

    policy = StableDiffusionPolicy.from_pretrained(
        asset_path("tiny_sd"), torch_dtype=dtype, lora_rank=8,
        lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]).to(device)
    unet, tokens = policy.unet, policy.tokenizer.model_max_length
    dim = unet.config.cross_attention_dim
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t = torch.tensor(500, device=device)
    out = {"forward": {}, "forward_backward": {}}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        unet.disable_adapters()
        for b in batches:
            x = torch.randn(b, *policy.latent_shape, generator=gen).to(device, policy.dtype)
            e = torch.randn(b, tokens, dim, generator=gen).to(device, policy.dtype)
            out["forward"][b] = _median_time(lambda x=x, e=e: (unet(x, t, encoder_hidden_states=e), sync()), repeats)
        unet.enable_adapters()
    if train_batch:
        x = torch.randn(train_batch, *policy.latent_shape, generator=gen).to(device, policy.dtype)
        e = torch.randn(train_batch, tokens, dim, generator=gen).to(device, policy.dtype)
        ts = torch.randint(0, 1000, (train_batch,), generator=gen).to(device)

        def fwd_bwd():
            unet(x, ts, encoder_hidden_states=e).sample.float().square().mean().backward()
            sync()

        out["forward_backward"][train_batch] = _median_time(fwd_bwd, repeats)
        with torch.no_grad():
            unet.disable_adapters()
            out["forward"].setdefault(train_batch, _median_time(
                lambda: (unet(x, ts, encoder_hidden_states=e), sync()), repeats))
            unet.enable_adapters()
    return out


def sampling_speed(batch: int, steps: int, repeats: int, device: str, dtype: str) -> tuple[float, float]:
    """Seconds per batch of `batch` images through diffalign's `rollout` (`steps` DDIM steps, CFG 4, decode
    included) and seconds of the `steps` bare-UNet forwards of 2·`batch` rows it needs (its floor), timed alternately
    in one loop so that both see the same machine state; medians over `repeats`."""
    import torch

    from diffalign.config.compose import asset_path
    from diffalign.models.stable_diffusion import StableDiffusionPolicy
    from diffalign.samplers.ode import PipelineODESampler
    from diffalign.samplers.rollout import rollout
    from diffalign.world.prompts import load_prompts

    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), torch_dtype=dtype).to(device)
    prompts = [r["prompt"] for r in load_prompts("heldout")]
    prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    unet = policy.unet
    x = torch.randn(2 * batch, *policy.latent_shape).to(device, policy.dtype)
    e = torch.randn(2 * batch, policy.tokenizer.model_max_length, unet.config.cross_attention_dim).to(device,
                                                                                                   policy.dtype)
    t = torch.tensor(500, device=device)
    sampled, floor = [], []
    for k in range(repeats + 1):
        gens = [torch.Generator().manual_seed(k * batch + i) for i in range(batch)]
        t0 = time.perf_counter()
        rollout(policy, prompts, PipelineODESampler(num_inference_steps=steps, guidance_scale=4.0), generator=gens)
        sync()
        t1 = time.perf_counter()
        with torch.no_grad():
            unet.disable_adapters()
            for _ in range(steps):
                unet(x, t, encoder_hidden_states=e)
            unet.enable_adapters()
        sync()
        t2 = time.perf_counter()
        if k:  # the first round warms up
            sampled.append(t1 - t0)
            floor.append(t2 - t1)
    return statistics.median(sampled), statistics.median(floor)


def read_config(out: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(out / ".hydra" / "config.yaml"))


def print_phases(info: dict, cfg: dict, floors: dict) -> None:
    fwd, fb = floors["forward"], floors["forward_backward"]
    data, ev, tr = cfg["data"], cfg["eval"], cfg["trainer"]
    rows = []
    data_steps = (data.get("sampler") or {}).get("num_inference_steps")
    if info["data"] > 0 and data.get("batch_size") and data_steps:
        n_samples = info.get("data_samples") or 0
        if n_samples:
            b = data["batch_size"]
            floor = n_samples / b * data_steps * fwd[2 * b]
            rows.append(("on-policy data", info["data"], floor, f"{n_samples} images, batch {b}"))
    b = tr["batch_size"]
    if 2 * b in fb:
        floor = info["steps"] * (fb[2 * b] + fwd[2 * b])
        rows.append(("training", info["train"], floor, f"{info['steps']} steps x {b} pairs"))
    if info["eval"] > 0 and info["eval_images"]:
        be = ev["batch_size"]
        floor = info["eval_images"] / be * ev["sampler"]["num_inference_steps"] * fwd[2 * be]
        rows.append(("evaluation", info["eval"], floor, f"{info['eval_images']} images, batch {be}"))
    print("phase            measured   floor   ratio   work")
    for name, measured, floor, work in rows:
        print(f"{name:<16} {measured:7.1f} s {floor:6.1f} s {measured / floor:6.2f}x   {work}")


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"diffalign-{rev[:12]}-"))
    path.rmdir()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-job", action="store_true", help="only the floors and the sampling benchmark")
    p.add_argument("--compare", metavar="REV", help="also time the main job of commit REV, alternating with this one")
    p.add_argument("--repeats", type=int, default=1, help="job runs per commit with --compare")
    p.add_argument("--batch", type=int, default=64, help="images per batch of the sampling benchmark")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--floor-repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the job(s)")
    args = p.parse_args()
    print(thread_settings())
    tmp = Path(tempfile.mkdtemp(prefix="diffalign-bench-"))
    infos, cfg, early_floors = {}, None, None
    if not args.skip_job:  # floors before the jobs too (the main job's batches: data 128, eval 64, training 32 pairs)
        early_floors = denoiser_floors([128, 256, 2 * args.batch], 64, args.floor_repeats, args.device, args.dtype)
        sources = {"this checkout": REPO}
        tree, metadata = None, {}
        if args.compare:
            tree = worktree(args.compare)
            sources = {args.compare: tree, "this checkout": REPO}
            metadata[args.compare] = shadow_metadata(tree)
        try:
            for r in range(args.repeats if args.compare else 1):
                for label, source in sources.items():
                    # each run in a folder of its own: no run reuses another's base evaluation (eval.reuse_base)
                    out = tmp / f"{label.replace(' ', '_')}-{r}" / "run"
                    info = summarize_job(out, run_job(source, out, args.overrides, metadata.get(label)))
                    res = json.loads((out / "results.json").read_text())
                    info["data_samples"] = res.get("data_stats", {}).get("num_samples")
                    infos.setdefault(label, []).append(info)
                    print_job(f"[{label}, run {r + 1}]", info)
                    cfg = read_config(out) if label == "this checkout" else cfg
                    shutil.rmtree(out.parent, ignore_errors=True)
        finally:
            if tree is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        if args.compare:
            a = statistics.median(i["wall"] for i in infos[args.compare])
            b = statistics.median(i["wall"] for i in infos["this checkout"])
            print(f"main job wall time: this checkout {b:.1f} s vs {args.compare} {a:.1f} s: ratio {b / a:.2f} "
                  f"(median of {len(infos['this checkout'])} alternating runs each)")
    batches = sorted({2 * args.batch, 128, 256, 2 * 32, 2 * 64, 2 * 128})
    train_batch = 2 * cfg["trainer"]["batch_size"] if cfg else 64
    if cfg:
        batches = sorted(set(batches) | {2 * cfg["data"].get("batch_size", 128), 2 * cfg["eval"]["batch_size"]})
    floors = denoiser_floors(batches, train_batch, args.floor_repeats, args.device, args.dtype)
    if early_floors is not None:  # the machine's speed drifts: the faster of the two measurements is the floor
        for kind in floors:
            for b, sec in early_floors[kind].items():
                floors[kind][b] = min(sec, floors[kind].get(b, sec))
    print("bare denoiser: " + ", ".join(f"forward({b}) {s * 1000:.0f} ms" for b, s in floors["forward"].items())
          + ", " + ", ".join(f"forward+backward({b}) {s * 1000:.0f} ms" for b, s in floors["forward_backward"].items()))
    if cfg and "this checkout" in infos:
        print_phases(infos["this checkout"][-1], cfg, floors)
    per_batch, floor = sampling_speed(args.batch, args.steps, args.floor_repeats, args.device, args.dtype)
    print(f"sampling: {args.batch / per_batch:.1f} images/s (batch {args.batch}, {args.steps} DDIM steps, CFG 4.0, "
          f"decode included); {per_batch:.2f} s per batch vs the bare denoiser's {floor:.2f} s: "
          f"{per_batch / floor:.2f}x its floor")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
