"""SePPO reference-selection ablation on the tiny shapes world (a miniature of SePPO's Table 4, arXiv:2410.05255).

Runs, for every seed, with the same number of optimizer updates and winners per update (the same winning images):

- ``seppo_uniform``  SePPO, pool of previous checkpoints, θ_r ~ U{0..k−1}       (recipe tiny_seppo)
- ``seppo_latest``   SePPO, θ_r = the latest snapshot (SPIN-Diffusion-like)
- ``seppo_initial``  SePPO, θ_r = θ_0 (DITTO-like)
- ``seppo_no_aaf``   SePPO, uniform pool, flipper off (x^r always a loser)
- ``dpo_pairs``      Diffusion-DPO on renderer pairs (winner = the same render, loser = a corrupted render)
- ``sft_winners``    plain fine-tuning on the winners

then scores the base model and each final LoRA on the held-out prompts with the verifier (GenEval-style accuracy) and
writes ``results.json`` and ``table.md`` under ``--out``. Each run uses one CPU thread; ``--workers`` run in parallel.

    python experiments/compare_seppo.py --seeds 0 1 2 --steps 40 --learning-rate 1e-3 --ref-steps 10 --workers 2
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

METHODS = {
    "seppo_uniform": ["recipe=tiny_seppo"],
    "seppo_latest": ["recipe=tiny_seppo", "reference.selection=latest"],
    "seppo_initial": ["recipe=tiny_seppo", "reference.selection=initial"],
    "seppo_no_aaf": ["recipe=tiny_seppo", "method.aaf_mode=off"],
    # the earlier default recipe (renderer pairs, beta 5000, attention LoRA), spelled out since tiny_dpo moved on
    "dpo_pairs": ["recipe=tiny_dpo", "model=tiny_sd", "method=diffusion_dpo", "data=shapes_pairs", "trainer.batch_size=16",
                  "eval.seeds=[0,1,2,3]"],
    "sft_winners": ["recipe=tiny_dpo", "model=tiny_sd", "method=sft", "data=shapes_winners", "trainer.batch_size=16",
                    "eval.seeds=[0,1,2,3]"],
}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from diffalign.config.compose import CONFIG_DIR, setup_hydra

    setup_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def evaluate(lora_dir: str | None, prompts_per_tag: int | None, seeds: list[int], steps: int) -> dict:
    """Held-out verifier accuracy of the tiny SD model (base when `lora_dir` is None)."""
    from hydra.utils import instantiate

    from diffalign.evaluation.generation import EvalConfig, generate, select_prompts
    from diffalign.evaluation.scoring import score, summarize
    from diffalign.rewards.reward_set import build_reward
    from diffalign.world.prompts import load_prompts

    cfg = compose(["model=tiny_sd"])  # every compared method trains LoRA on the attention projections
    policy = instantiate(cfg.model)
    if lora_dir is not None:
        policy.load_lora_weights(lora_dir)
    policy.unet.eval()
    ecfg = EvalConfig(prompts="heldout", prompts_per_tag=prompts_per_tag, seeds=seeds, batch_size=64,
                      sampler={"name": "ode", "num_inference_steps": steps,
                               "guidance_scale": cfg.eval.sampler.guidance_scale})
    rows = select_prompts(load_prompts("heldout"), prompts_per_tag)
    images, records = generate(policy, rows, seeds, ecfg)
    scored = score({"geneval_shapes": build_reward("geneval_shapes")}, images, rows, records)
    summary = summarize(scored, records)
    return {"accuracy": summary["geneval_shapes/accuracy"], "accuracy_se": summary["geneval_shapes/accuracy_se"],
            "dense": summary["geneval_shapes/mean"], "num_images": summary["num_images"],
            "correct": scored["geneval_shapes"]["correct"]}


def run_one(job: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    from diffalign.train.preference import train

    out = Path(job["out"]) / f"{job['method']}-seed{job['seed']}"
    overrides = METHODS[job["method"]] + [
        f"output_dir={out}", f"seed={job['seed']}", f"trainer.max_steps={job['steps']}", "eval.enabled=false",
        "trainer.log_with=none", f"trainer.checkpointing_steps={job['steps']}", "trainer.keep_last=1",
        f"trainer.lr_warmup_steps={max(1, job['steps'] // 10)}", f"trainer.optimizer.lr={job['learning_rate']}",
    ]
    if job["method"].startswith("seppo"):
        overrides.append(f"reference.save_every={max(1, math.ceil(job['steps'] / 7))}")  # K = 7 snapshots per run
        overrides.append(f"sampler.num_inference_steps={job['ref_steps']}")  # the x^r sampler
    record = out / "compare.json"
    if record.is_file():  # finished earlier: reuse (delete the run folder to redo it)
        return json.loads(record.read_text())
    if not (out / "results.json").is_file():
        train(compose(overrides))
    results = json.loads((out / "results.json").read_text())  # written by the training loop
    metrics = evaluate(str(out / "final"), job["prompts_per_tag"], job["eval_seeds"], job["eval_steps"])
    tail = results["history_tail"][-1]
    row = {**job, "train_seconds": results["train_seconds"], **metrics, "final_loss": tail.get("loss"),
           "final_flip_rate": tail.get("flip_rate")}
    record.write_text(json.dumps(row))
    return row


def mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="optimizer updates per run (batch 16)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="the recipes use 1e-4 over 100 updates")
    parser.add_argument("--ref-steps", type=int, default=10, help="DDIM steps of SePPO's reference sampler")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prompts-per-tag", type=int, default=None, help="held-out prompts per tag (all: 117)")
    parser.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--out", default="runs/compare_seppo")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    jobs = [{"method": m, "seed": s, "steps": args.steps, "out": str(out), "prompts_per_tag": args.prompts_per_tag,
             "eval_seeds": args.eval_seeds, "eval_steps": args.eval_steps, "learning_rate": args.learning_rate,
             "ref_steps": args.ref_steps} for s in args.seeds for m in args.methods]
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=get_context("spawn")) as pool:
        base_future = pool.submit(evaluate, None, args.prompts_per_tag, args.eval_seeds, args.eval_steps)
        futures = [pool.submit(run_one, job) for job in jobs]
        base = base_future.result()
        print(f"[compare] base: accuracy {base['accuracy']:.3f} ± {base['accuracy_se']:.3f}", flush=True)
        runs = []
        for future in futures:
            runs.append(future.result())
            r = runs[-1]
            print(f"[compare] {r['method']} seed {r['seed']}: accuracy {r['accuracy']:.3f} ± {r['accuracy_se']:.3f} "
                  f"({r['train_seconds']:.0f}s train)", flush=True)
    rows = []
    for method in args.methods:
        mine = [r for r in runs if r["method"] == method]
        acc, acc_se = mean_se([r["accuracy"] for r in mine])
        gains = [sum(c - b for c, b in zip(r["correct"], base["correct"])) / len(base["correct"]) for r in mine]
        rows.append({"method": method, "seeds": len(mine), "accuracy": acc, "accuracy_se_over_seeds": acc_se,
                     "per_seed": [round(r["accuracy"], 4) for r in mine], "gain_over_base": mean_se(gains)[0],
                     "train_seconds": sum(r["train_seconds"] for r in mine) / len(mine),
                     "final_flip_rate": [r["final_flip_rate"] for r in mine]})
    for r in runs:
        r.pop("correct")
    base.pop("correct")
    total = time.time() - t_start
    (out / "results.json").write_text(json.dumps({"args": vars(args), "base": base, "summary": rows, "runs": runs,
                                                  "total_seconds": total}, indent=2))
    lines = [f"Base model: {base['accuracy']:.3f} ± {base['accuracy_se']:.3f} (s.e. over {base['num_images']} images)",
             "", "| method | held-out accuracy (mean ± s.e. over seeds) | per seed | gain over base | train s/run |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['method']} | {row['accuracy']:.3f} ± {row['accuracy_se_over_seeds']:.3f} | "
                     f"{', '.join(f'{a:.3f}' for a in row['per_seed'])} | {row['gain_over_base']:+.3f} | "
                     f"{row['train_seconds']:.0f} |")
    lines.append("")
    lines.append(f"Command: `python {' '.join(sys.argv)}`; total {total / 60:.1f} min.")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
