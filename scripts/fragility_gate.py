"""The fragility gate of a base model (`diffalign.evaluation.fragility`): held-out verifier accuracy, the accuracy
change under random LoRA directions calibrated to image drifts 0.02 and 0.03 (mean ± s.e. over directions), and the
fraction of correct images that a one-pixel edge change of one object flips.

    python scripts/fragility_gate.py model=tiny_sd3
    python scripts/fragility_gate.py model=tiny_sd --directions 6 --seeds 0 1
    python scripts/fragility_gate.py model=tiny_flux --guidance-scale 4.5 --json /tmp/gate_flux.json

Every held-out prompt (117) × the seeds, sampled as the documented evaluation samples (``sampler=ode``, 20 steps,
CFG 4); Hydra overrides after the options select the model (``model=...``, ``model.pretrained_model_name_or_path=``
for a checkpoint folder, ``model.lora_rank=``). The defaults (seed 0, 4 directions per drift, sigma calibrated on
every image, about 2 tries per direction) sample about 117 × 17 images: about 10 minutes for tiny_sd3 on two idle
cores (3.5 images/s measured on one loaded core at 20 steps).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drifts", nargs="+", type=float, default=[0.02, 0.03])
    p.add_argument("--directions", type=int, default=4)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--prompts-per-tag", type=int, default=0, help="0 = every held-out prompt")
    p.add_argument("--calibration-images", type=int, default=0,
                   help="calibrate sigma on this many evenly spaced images (0 = on every image: exact drifts)")
    p.add_argument("--tolerance", type=float, default=0.1, help="relative tolerance of the calibrated drift")
    p.add_argument("--steps", type=int, default=20, help="sampler num_inference_steps")
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the train config, e.g. model=tiny_sd3")
    args = p.parse_args()

    from hydra import compose, initialize_config_dir

    from diffalign.config.compose import CONFIG_DIR, setup_hydra
    from diffalign.evaluation.fragility import fragility_gate
    from diffalign.evaluation.generation import EvalConfig, select_prompts
    from diffalign.lora.initial import build_policy
    from diffalign.world.prompts import load_prompts

    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/fragility_gate", *args.overrides])
    policy = build_policy(cfg)
    rows = select_prompts(load_prompts("heldout"), args.prompts_per_tag or None)
    ecfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": args.steps, "guidance_scale": args.guidance_scale},
                      batch_size=args.batch_size)
    print(f"fragility gate: {' '.join(args.overrides) or 'default model'}; {len(rows)} held-out prompts x seeds "
          f"{args.seeds}; {args.steps} steps, CFG {args.guidance_scale}; drifts {args.drifts}, {args.directions} "
          f"directions, sigma calibrated on {args.calibration_images or 'every'} image(s) to ±{args.tolerance:.0%}",
          flush=True)
    report = fragility_gate(policy, rows, args.seeds, ecfg, drifts=args.drifts, directions=args.directions,
                            calibration_images=args.calibration_images, tolerance=args.tolerance,
                            log=lambda line: print("  " + line, flush=True))
    for line in report.lines():
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overrides": args.overrides, "seeds": args.seeds, "passes": report.passes, **asdict(report)},
                      f, indent=1)


if __name__ == "__main__":
    main()
