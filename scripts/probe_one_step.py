"""One-step probe of an online method: does its first update point uphill on the reward?

Composes a run's config exactly as ``diffalign-train`` would (recipe + overrides), samples one epoch of groups as the
online loop does, scores them, computes the group advantages and the method's loss over every trained transition,
and takes its gradient g. Then it measures the mean reward of fixed probe samples (deterministic sampler, fixed
seeds, the monitor's convention) after one step θ − lr·d along two directions, each with its opposite:

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

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    p.add_argument("--probe-prompts", type=int, default=16)
    p.add_argument("--probe-seeds", type=int, default=4)
    p.add_argument("--epoch", type=int, default=0, help="which epoch's rollouts (seeds) to take the gradient on")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from diffalign.advantages import group_advantages
    from diffalign.cli import CONFIG_DIR, _setup, check_reward_overrides
    from diffalign.deprecation import migrate_config
    from diffalign.init_lora import build_policy
    from diffalign.objectives.policy_gradient import train_transitions
    from diffalign.plugins import build_selected_rewards
    from diffalign.samplers.groups import group_rollout
    from diffalign.samplers.rollout import rollout
    from diffalign.world.prompts import load_prompts

    _setup()
    check_reward_overrides(args.overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/probe", *args.overrides])
    migrate_config(cfg, args.overrides)
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg)
    objective = instantiate(cfg.method)
    reference = instantiate(cfg.reference)  # the KL term's reference (Flow-GRPO), set up as the online loop does
    reference.setup(policy)
    if getattr(objective, "data_flow", None) != "online_trajectories":
        raise SystemExit("the probe handles policy-gradient methods (DDPO, Flow-GRPO, ViPO)")
    rewards = build_selected_rewards(cfg.reward)
    name = next(iter(rewards))
    reward = rewards[name]
    on, sp = cfg.online, cfg.sampler
    rows = load_prompts(cfg.online.get("prompts", "train"))
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + args.epoch)
    pick = torch.randint(len(rows), (on.groups_per_epoch,), generator=gen)
    epoch_rows = [rows[int(i)] for i in pick]
    with torch.no_grad():
        traj, group_ids = group_rollout(
            policy, [r["prompt"] for r in epoch_rows], on.group_size,
            group_indices=list(range(on.groups_per_epoch)), seed=cfg.seed, epoch=args.epoch,
            shared_initial_noise=on.shared_initial_noise, sampler=sp.name, num_inference_steps=sp.num_inference_steps,
            guidance_scale=sp.guidance_scale, eta=sp.get("eta", 0.0), noise_level=sp.get("noise_level", 0.0),
            rollout_batch_size=on.rollout_batch_size, reduction=getattr(objective, "log_prob_reduction", "mean"))
    scores = reward(traj.images, traj.prompts, [r for r in epoch_rows for _ in range(on.group_size)]).scores.float()
    advantages, stats = group_advantages(scores, group_ids, std=on.advantage_std, clip=on.advantage_clip,
                                         correction=on.advantage_std_correction, eps=on.advantage_eps)
    print(f"rollouts: {len(scores)}, reward {float(scores.mean()):.4f} ± {float(scores.std()):.4f} (std); "
          f"zero-std groups {stats['zero_std_fraction']:.2f}; |A| mean {float(advantages.abs().mean()):.3f}")
    prepare = getattr(objective, "prepare_epoch", None)
    if prepare is not None:
        print(f"prepare_epoch: {prepare(policy, traj, advantages)}")
    steps = train_transitions(len(traj.timesteps), objective.timestep_fraction,
                              getattr(objective, "timestep_selection", "random"),
                              generator=torch.Generator().manual_seed(0))
    params = policy.trainable_parameters()
    policy.denoiser.train()
    rows_all = torch.arange(len(scores))
    total = 0.0
    for k in steps:
        kwargs = {"rows": rows_all} if prepare is not None else {}
        loss, _ = objective(policy, traj, advantages, k, reference=reference, **kwargs)
        (loss / len(steps)).backward()
        total += float(loss.detach()) / len(steps)
    grads = [prm.grad.detach().clone() for prm in params]
    gnorm = torch.sqrt(sum((g**2).sum() for g in grads))
    print(f"loss {total:.6f}; ‖g‖ {float(gnorm):.3e}; trained transitions {steps}")
    policy.denoiser.eval()
    held = load_prompts(cfg.monitor.prompts)  # the monitor's held-out prompts (video_heldout for video recipes)
    probe_rows = held[:: max(1, len(held) // args.probe_prompts)][: args.probe_prompts]
    jobs = [(s, i) for s in range(args.probe_seeds) for i in range(len(probe_rows))]

    @torch.no_grad()
    def probe() -> float:
        gens = [torch.Generator().manual_seed(s * 1_000_003 + i) for s, i in jobs]
        images = rollout(policy, [probe_rows[i]["prompt"] for _, i in jobs], generator=gens, eta=0.0,
                         num_inference_steps=sp.num_inference_steps, guidance_scale=sp.guidance_scale,
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
