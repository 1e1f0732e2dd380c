"""Benchmark of the README's main job (`diffalign-train` with no overrides) and of tiny-world sampling speed.

Prints the wall time of the whole job and of its parts (setup, on-policy data, training, evaluation) as recorded in the run's
``results.json``, the held-out accuracy of base vs fine-tuned, and sampling throughput of the shipped tiny model
(images/s at 20 DDIM steps with classifier-free guidance, measured through diffalign's rollout).

    python scripts/bench_main_job.py                 # runs the main job once, then the sampling benchmark
    python scripts/bench_main_job.py --skip-job      # sampling benchmark only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def sampling_speed(batch: int, steps: int, repeats: int) -> float:
    from diffalign.cli import asset_path
    from diffalign.models.stable_diffusion import StableDiffusionPolicy
    from diffalign.samplers.rollout import rollout
    from diffalign.world.prompts import load_prompts

    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"))
    prompts = [r["prompt"] for r in load_prompts("heldout")][:batch]
    prompts = (prompts * (batch // len(prompts) + 1))[:batch]
    rollout(policy, prompts[:4], num_inference_steps=2, guidance_scale=4.0, eta=0.0)  # warm-up
    times = []
    for r in range(repeats):
        gens = [torch.Generator().manual_seed(r * batch + i) for i in range(batch)]
        t0 = time.perf_counter()
        rollout(policy, prompts, num_inference_steps=steps, guidance_scale=4.0, eta=0.0, generator=gens)
        times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-job", action="store_true")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the job")
    args = p.parse_args()
    if not args.skip_job:
        out = Path(tempfile.mkdtemp(prefix="diffalign-bench-")) / "run"
        t0 = time.perf_counter()
        subprocess.run(["diffalign-train", f"output_dir={out}", "trainer.log_with=none", *args.overrides], check=True)
        wall = time.perf_counter() - t0
        res = json.loads((out / "results.json").read_text())
        ev = res.get("eval", {})
        print(f"main job wall time: {wall:.1f} s (process start to exit)")
        data = res.get("data_seconds", 0.0)
        setup = res["total_seconds"] - data - res["train_seconds"] - res.get("eval_seconds", 0)
        print(f"  inside the job: {res['total_seconds']:.1f} s = setup {setup:.1f} s"
              f" + on-policy data (sampling and judging) {data:.1f} s + training {res['train_seconds']:.1f} s ({res['global_step']} steps)"
              f" + evaluation {res.get('eval_seconds', 0):.1f} s")
        for label, summary in ev.get("variants", {}).items():
            print(f"  {label}: held-out accuracy {summary['geneval_shapes/accuracy']:.3f} ± "
                  f"{summary['geneval_shapes/accuracy_se']:.3f} (n={summary['num_images']})")
        gain = ev.get("finetuned_vs_base", {}).get("geneval_shapes/accuracy_gain")
        if gain:
            print(f"  gain {gain['gain']:+.3f} ± {gain['se']:.3f} (paired s.e.), {gain['gain_over_se']:.1f} s.e.")
    ips = sampling_speed(args.batch, args.steps, args.repeats)
    print(f"sampling: {ips:.1f} images/s (batch {args.batch}, {args.steps} DDIM steps, CFG 4.0, "
          f"{torch.get_num_threads()} threads)")


if __name__ == "__main__":
    sys.exit(main())
