"""The cost model's measurements: an online epoch's time against rollouts per epoch, sampling steps and resolution
(three points each, in one run), and the reference pool's memory against K; a CSV and a matplotlib plot.

Epochs (``scripts/bench_online.py``'s measurement: the loop's own ``_setup`` / ``_epoch``, phases timed from outside,
each beside the bare denoiser's floor) of ``recipe=tiny_ddpo`` with the ``brightness`` reward (it scores any
resolution) at a base point (8 prompts × 8 samples, 20 DDIM steps, 32 px), moving one factor at a time:

- rollouts per epoch: ``online.groups_per_epoch`` ∈ {½, 1, 2} × the base (× ``online.group_size``);
- sampling steps: ``sampler.num_inference_steps`` ∈ {½, 1, 2} × the base;
- resolution: the denoiser's default latent side ∈ {1, 2, 4} × the base, 32 / 64 / 128 px (the tiny UNet runs at
  any multiple of 8 latents: its ``config.sample_size``, which the policy's ``latent_shape`` reads, set after set-up).

A linear cost model predicts an epoch as rollouts × steps × t_fwd(rows) + units × t_fwd+bwd(rows) (+ the reward);
the CSV gives each point's measured phases next to its floors, so the fit can be made and checked.

The reference pool (``reference=pool``, SePPO's): K ∈ {1, 3, 7} snapshots of the policy's LoRA
(`diffalign.reference.pool.PoolReference`, ``save_every=1``, ``keep=K``, filled by K updates' ``on_step``), its stored
bytes (``stored_bytes``: K × the adapter's float32 bytes) and the process's resident-set growth while it fills.

    python scripts/cost_model.py --out cost/                 # cost/cost_model.csv, cost/pool_memory.csv, cost/cost_model.png
    python scripts/cost_model.py --out cost/ --quick         # small points (a test of the tool)
"""

from __future__ import annotations

import argparse
import csv
import gc
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
BASE = {"groups_per_epoch": 8, "num_inference_steps": 20, "latent_side": 8}  # 8 latents: the tiny world's 32 px
QUICK_BASE = {"groups_per_epoch": 2, "num_inference_steps": 4, "latent_side": 8}
VAE_FACTOR = 4  # pixels per latent cell of the tiny SD's VAE (32 px images, 8 x 8 latents)
FACTORS = {"groups_per_epoch": (0.5, 1, 2), "num_inference_steps": (0.5, 1, 2), "latent_side": (1, 2, 4)}
POOL_K = (1, 3, 7)
COLUMNS = ["axis", "value", "rollouts", "num_inference_steps", "resolution_px", "epoch_s", "rollout_s", "reward_s",
           "advantages_s", "update_s", "rollout_floor_s", "update_floor_s", "epoch_floor_s"]


def points(base: dict) -> list[tuple[str, dict]]:
    """(axis, settings) of every measurement: the base point once, then each axis's other two values."""
    out = [("base", dict(base))]
    for axis, factors in FACTORS.items():
        for f in factors:
            if f == 1:
                continue
            point = dict(base)
            point[axis] = max(1, int(base[axis] * f)) if axis != "latent_side" else base[axis] * f
            out.append((axis, point))
    return out


def measure_point(point: dict, group_size: int, quick: bool, epochs: int) -> dict:
    """One epoch measurement of `point` (`bench_online.measure`); a CSV row."""
    sys.path.insert(0, str(SCRIPTS))
    from bench_online import PHASES, measure, recipe_overrides, summarize

    overrides = recipe_overrides("tiny_ddpo", quick, [
        "reward=[brightness]", f"online.groups_per_epoch={point['groups_per_epoch']}",
        f"online.group_size={group_size}", f"sampler.num_inference_steps={point['num_inference_steps']}",
        f"online.tracker_min_count={min(8, group_size)}"])
    side = point["latent_side"]

    def set_resolution(run):
        denoiser = run.policy.denoiser
        if denoiser.config.sample_size != side:
            denoiser.register_to_config(sample_size=side)

    result = measure("tiny_ddpo", overrides, warmup=1, epochs=epochs, floor_repeats=2, after_setup=set_resolution)
    med = summarize(result)
    row = {"rollouts": point["groups_per_epoch"] * group_size, "num_inference_steps": point["num_inference_steps"],
           "resolution_px": side * VAE_FACTOR, "epoch_s": med["total"],
           **{f"{p}_s": med[p] for p in PHASES},
           "rollout_floor_s": med["rollout_floor"], "update_floor_s": med["update_floor"],
           "epoch_floor_s": sum(med[f"{p}_floor"] for p in (*PHASES, "other"))}
    gc.collect()
    return row


def pool_memory(ks=POOL_K) -> list[dict]:
    """Stored bytes and resident-set growth of a `PoolReference` holding K snapshots of the tiny SD policy's LoRA."""
    import torch

    from diffalign.models.stable_diffusion import StableDiffusionPolicy

    sys.path.insert(0, str(SCRIPTS))
    from bench_online import _first_import, asset_path
    from bench_real_size import _status

    PoolReference = _first_import(("diffalign.reference.pool", "PoolReference"),
                                  ("diffalign.reference", "PoolReference"))

    rows = []
    for k in ks:
        policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), lora_rank=8)
        pool = PoolReference(save_every=1, keep=k)
        pool.setup(policy)
        lora = [p for n, p in policy.denoiser.named_parameters() if "lora_" in n and p.requires_grad]
        before = _status("VmRSS")
        for step in range(k):
            with torch.no_grad():
                for p in lora:  # a stand-in for an update: every snapshot differs
                    p.add_(0.01)
            pool.on_step(policy, step)
        rows.append({"K": k, "snapshots": len(pool.snapshots), "stored_bytes": pool.stored_bytes(),
                     "adapter_float32_bytes": 4 * sum(p.numel() for p in lora),
                     "rss_growth_bytes": _status("VmRSS") - before})
        del policy, pool
        gc.collect()
    return rows


def plot(rows: list[dict], pool: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (axis, x_key, label) in zip(axes, (("groups_per_epoch", "rollouts", "rollouts per epoch"),
                                               ("num_inference_steps", "num_inference_steps", "sampling steps"),
                                               ("latent_side", "resolution_px", "resolution (px)"))):
        pts = sorted((r for r in rows if r["axis"] in (axis, "base")), key=lambda r: r[x_key])
        xs = [r[x_key] for r in pts]
        ax.plot(xs, [r["epoch_s"] for r in pts], "o-", label="epoch")
        ax.plot(xs, [r["rollout_s"] for r in pts], "s--", label="rollout")
        ax.plot(xs, [r["update_s"] for r in pts], "^--", label="update")
        ax.plot(xs, [r["epoch_floor_s"] for r in pts], ":", color="gray", label="denoiser floor")
        ax.set_xlabel(label)
        ax.set_ylabel("seconds")
        ax.set_xticks(xs)
    axes[0].legend(fontsize=8)
    ax = axes[3]
    ax.plot([r["K"] for r in pool], [r["stored_bytes"] / 2**20 for r in pool], "o-", label="stored")
    ax.plot([r["K"] for r in pool], [r["rss_growth_bytes"] / 2**20 for r in pool], "s--", label="RSS growth")
    ax.set_xlabel("reference pool K")
    ax.set_ylabel("MiB")
    ax.set_xticks([r["K"] for r in pool])
    ax.legend(fontsize=8)
    fig.suptitle("tiny_ddpo epoch cost (one factor at a time) and the reference pool's memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for cost_model.csv, pool_memory.csv, the plot")
    p.add_argument("--quick", action="store_true", help="small points (2 groups x 4, 4 steps): a test of the tool")
    p.add_argument("--epochs", type=int, default=1, help="measured epochs per point (after one warm-up)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    base, group_size = (QUICK_BASE, 4) if args.quick else (BASE, 8)
    # the pool first (seconds), then the epoch points, the CSV and the plot rewritten after each point: a run stopped
    # early (a measuring window's end) keeps every point it finished
    pool = pool_memory()
    with open(args.out / "pool_memory.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(pool[0]))
        writer.writeheader()
        writer.writerows(pool)
    for r in pool:
        print(f"reference pool K={r['K']}: {r['stored_bytes'] / 2**20:.2f} MiB stored "
              f"({r['adapter_float32_bytes'] / 2**20:.2f} MiB per snapshot), RSS +{r['rss_growth_bytes'] / 2**20:.1f} "
              "MiB", flush=True)
    rows = []
    for axis, point in points(base):
        row = {"axis": axis, "value": point[axis] if axis != "base" else "", **measure_point(point, group_size,
                                                                                           args.quick, args.epochs)}
        rows.append(row)
        print(f"{axis:<20} rollouts {row['rollouts']:4d}, {row['num_inference_steps']:3d} steps, "
              f"{row['resolution_px']:4d} px: epoch {row['epoch_s']:.2f} s (floor {row['epoch_floor_s']:.2f} s)",
              flush=True)
        with open(args.out / "cost_model.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, pool, args.out / "cost_model.png")
    print(f"wrote {args.out / 'cost_model.csv'}, {args.out / 'pool_memory.csv'}, {args.out / 'cost_model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
