"""One-step probe of an online method: does its first update point uphill on the reward?

Composes a run's config exactly as ``diffalign-train`` would (recipe + overrides), samples one epoch of groups as the
online loop does (with the probe's own fixed prompt draw, ``experiments/probes.py``, ``PROMPT_DRAWS``), scores them,
computes the group advantages and the method's loss over every trained transition, and takes its gradient g
(``experiments/probes.py``, shared with ``experiments/gradient_consistency.py``). Then it measures the mean reward of
fixed probe samples (deterministic sampler, fixed seeds, the monitor's convention) after one step θ − lr·d along two
directions, each with its opposite:

- ``adam``: d = sign(g), what Adam's first update is (m̂/√v̂ = g/|g| elementwise, bias-corrected, ε ≪ |g|);
- ``sgd``: d = g/‖g‖ scaled to the same norm as lr·sign(g).

A method whose update raises the reward shows Δ(θ − lr·d) > 0 > Δ(θ + lr·d). Prints the gradient's norm, the
loss, the clip fraction, the probe rewards and, for ViPO, the maps' mean.

    python scripts/probe_one_step.py recipe=tiny_vipo_image reward=[brightness]
    python scripts/probe_one_step.py recipe=tiny_vipo_image reward=[brightness] method.map=ones
    python scripts/probe_one_step.py recipe=tiny_flow_grpo reward=[brightness] --lrs 1e-3 1e-2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--probe-prompts", type=int, default=16)
    p.add_argument("--probe-seeds", type=int, default=4)
    p.add_argument("--epoch", type=int, default=0, help="which epoch's rollouts (seeds) to take the gradient on")
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()  # overrides may come before, between or after the flags
    for flag, value, least in (("--probe-prompts", args.probe_prompts, 1), ("--probe-seeds", args.probe_seeds, 1),
                               ("--epoch", args.epoch, 0)):
        if value < least:
            raise SystemExit(f"{flag} {value}: pass an integer ≥ {least}")
    if any(lr <= 0 for lr in args.lrs):
        raise SystemExit(f"--lrs {args.lrs}: every learning rate must be > 0")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))  # experiments/probes.py
    from probes import build_probe_setup, compose_run_config, epoch_gradient, run_advantages, sample_epoch

    from diffalign.samplers.ode import PipelineODESampler
    from diffalign.samplers.rollout import rollout
    from diffalign.world.prompts import load_prompts

    try:
        setup = build_probe_setup(compose_run_config(args.overrides, "/tmp/probe"))
    except (ValueError, ImportError) as err:  # an unknown key or reward, or not a policy-gradient method: one line
        raise SystemExit(f"probe_one_step.py: error: {err}") from None
    cfg = setup.cfg
    policy, reward, sp = setup.policy, setup.reward, cfg.sampler
    # the probe's own prompt draw (docs' figures use it), not the online loop's: PROMPT_DRAWS of experiments/probes.py
    traj, group_ids, scores, _ = sample_epoch(setup, args.epoch, draw="probe")
    advantages, stats = run_advantages(setup, scores, group_ids)
    print(f"rollouts: {len(scores)}, reward {float(scores.mean()):.4f} ± {float(scores.std()):.4f} (std); "
          f"zero-std groups {stats['zero_std_fraction']:.2f}; |A| mean {float(advantages.abs().mean()):.3f}")
    g = epoch_gradient(setup, traj, advantages)
    if g["prepared"] is not None:
        print(f"prepare_epoch: {g['prepared']}")
    grads, params = g["grads"], policy.trainable_parameters()
    gnorm = torch.sqrt(sum((x**2).sum() for x in grads))
    print(f"loss {g['loss']:.6f}; ‖g‖ {float(gnorm):.3e}; trained transitions {g['steps']}")
    held = load_prompts(cfg.monitor.prompts)  # the monitor's held-out prompts (video_heldout for video recipes)
    probe_rows = held[:: max(1, len(held) // args.probe_prompts)][: args.probe_prompts]
    jobs = [(s, i) for s in range(args.probe_seeds) for i in range(len(probe_rows))]

    @torch.no_grad()
    def probe() -> float:
        gens = [torch.Generator().manual_seed(s * 1_000_003 + i) for s, i in jobs]
        sampler = PipelineODESampler(num_inference_steps=sp.num_inference_steps, guidance_scale=sp.guidance_scale)
        images = rollout(policy, [probe_rows[i]["prompt"] for _, i in jobs], sampler, generator=gens,
                         fuse_lora=True).images
        return float(reward(images, [probe_rows[i]["prompt"] for _, i in jobs],
                            [probe_rows[i] for _, i in jobs]).scores.mean())

    base = probe()
    print(f"probe reward at θ: {base:.4f} ({len(jobs)} deterministic samples)")
    originals = [prm.detach().clone() for prm in params]
    signs = [g.sign() for g in grads]
    sign_norm = torch.sqrt(sum((s**2).sum() for s in signs))
    for lr in args.lrs:
        line = [f"lr {lr:g}:"]
        for label, direction in (("adam", signs), ("sgd", [g * (sign_norm / gnorm) for g in grads])):
            for sgn, tag in ((-1, "step"), (1, "opposite")):
                with torch.no_grad():
                    for prm, orig, d in zip(params, originals, direction):
                        prm.copy_(orig + sgn * lr * d)
                line.append(f"{label} {tag} Δ {probe() - base:+.4f}")
        with torch.no_grad():
            for prm, orig in zip(params, originals):
                prm.copy_(orig)
        print("  ".join(line))


if __name__ == "__main__":
    sys.exit(main())
