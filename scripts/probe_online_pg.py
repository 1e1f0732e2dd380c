"""Exploratory probe (not a diffalign method yet): does an online DDPO-style policy gradient with the verifier reward
move held-out accuracy on the tiny world, where the offline objectives did not? Informs the default recipe (issue 5).

DDPO (Black et al., arXiv:2305.13301, §4.3, importance-sampled PPO-clip over the denoising steps; ALGORITHMS.md §2.2)
with group-normalised advantages (§1.5): for each epoch, sample `group_size` images for each of `prompts_per_epoch`
train prompts with DDIM η=1, score them with `geneval_shapes` (dense), A = (r − mean_group) / (std_group + 1e-4)
clipped to [−5, 5], then one PPO-clip pass over every stored step.

    python scripts/probe_online_pg.py --epochs 12
"""

from __future__ import annotations

import argparse
import time

import torch

from diffalign.cli import asset_path
from diffalign.evaluate import EvalConfig, evaluate_policy
from diffalign.models.stable_diffusion import StableDiffusionPolicy
from diffalign.rewards.geneval_shapes import GenevalShapes
from diffalign.samplers.rollout import recompute_log_probs, rollout
from diffalign.world.prompts import load_prompts, sample_train_specs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--prompts-per-epoch", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip-range", type=float, default=1e-4)
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), lora_rank=8, lora_alpha=8)
    reward = GenevalShapes()
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=args.lr)
    t0 = time.time()
    for epoch in range(args.epochs):
        specs = sample_train_specs(args.prompts_per_epoch, seed=10_000 + epoch)
        rows = [s for s in specs for _ in range(args.group_size)]
        prompts = [r["prompt"] for r in rows]
        gens = [torch.Generator().manual_seed(epoch * 100_000 + i) for i in range(len(rows))]
        policy.unet.eval()
        traj = rollout(policy, prompts, num_inference_steps=args.steps, guidance_scale=4.0, eta=1.0, generator=gens)
        r = reward(traj.images, prompts, rows).scores.view(-1, args.group_size)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).clamp(-5, 5).flatten()
        policy.unet.train()
        steps = [k for k in range(args.steps) if bool(traj.trainable[k])]
        for start in range(0, len(rows), args.minibatch):
            idx = torch.arange(start, min(start + args.minibatch, len(rows)))
            sub = type(traj)(traj.latents[idx], traj.timesteps, traj.log_probs[idx], traj.trainable,
                             traj.prompt_embeds.index(idx), None, [prompts[i] for i in idx], traj.guidance_scale,
                             traj.eta)
            opt.zero_grad(set_to_none=True)
            for k in steps:
                new = recompute_log_probs(policy, sub, [k])[:, 0]
                ratio = torch.exp(new - traj.log_probs[idx, k])
                a = adv[idx]
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - args.clip_range, 1 + args.clip_range)).mean()
                (loss / len(steps)).backward()
            torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), 1.0)
            opt.step()
        print(f"epoch {epoch}: reward {r.mean():.3f}, correct {(r == 1).float().mean():.3f}, "
              f"{time.time() - t0:.0f}s", flush=True)
    policy.unet.eval()
    metrics = evaluate_policy(policy, load_prompts("heldout"), {"geneval_shapes": reward},
                              EvalConfig(seeds=[0, 1, 2, 3]), "runs/probe_online_pg",
                              {"base": True, "finetuned": False})
    print(metrics["finetuned_vs_base"], f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
