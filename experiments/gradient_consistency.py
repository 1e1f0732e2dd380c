"""Is a policy-gradient method's update direction consistent from epoch to epoch, with the real reward and with
random scores?

Composes a run's config as ``diffalign-train`` would (recipe + overrides; the set-up, epoch sampling and gradient are
``experiments/probes.py``, shared with ``scripts/probe_one_step.py``) and, at the base weights, for each of
``--epochs`` epochs (the online loop's prompts and seeds of that epoch): samples the epoch's groups, scores them, and
takes the method's gradient over every trained transition twice — with the group advantages of the real reward, and
with those of random scores (standard normal per rollout, normalised in each group the same way). It prints the
cosine between every pair of epochs' gradients for each kind, and between the real and random gradient of the same
epoch; per epoch also the rewards' mean spread inside a group, the mean |advantage| and the fraction of zero-variance
groups.

Reading: random advantages give gradients with cosine ≈ 0 between epochs (n Adam steps then move the weights about
√n steps' worth); a reward whose gradient has a component that repeats from epoch to epoch (signal, or a bias of the
credit assignment) gives cosines > 0 and moves the weights about n steps' worth.

    python experiments/gradient_consistency.py recipe=tiny_vipo_wan method.map=ones method.reduction=scalar_weighted
    python experiments/gradient_consistency.py recipe=tiny_vipo_image reward=[brightness] --epochs 3
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3, help="epochs (0..N-1) whose gradients are compared (≥ 2)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args()  # overrides may come before, between or after the flags
    if args.epochs < 2:
        raise SystemExit(f"--epochs {args.epochs}: at least 2 epochs are needed to compare gradients")

    from probes import build_probe_setup, compose_run_config, epoch_gradient, run_advantages, sample_epoch

    try:
        setup = build_probe_setup(compose_run_config(args.overrides, "/tmp/gradient_consistency"))
    except (ValueError, ImportError) as err:  # an unknown key or reward, or not a policy-gradient method: one line
        raise SystemExit(f"gradient_consistency.py: error: {err}") from None

    def gradient(traj, advantages) -> torch.Tensor:
        return torch.cat([g.flatten() for g in epoch_gradient(setup, traj, advantages)["grads"]])

    grads: dict[str, list[torch.Tensor]] = {"reward": [], "random": []}
    for epoch in range(args.epochs):  # the online loop's prompts and noise of each epoch
        traj, group_ids, scores, _ = sample_epoch(setup, epoch, draw="online")
        noise = torch.randn(len(scores), generator=torch.Generator().manual_seed(1000 + epoch))
        for kind, s in (("reward", scores), ("random", noise)):
            adv, stats = run_advantages(setup, s, group_ids)
            grads[kind].append(gradient(traj, adv))
            if kind == "reward":
                reward_adv, zero = adv, stats["zero_std_fraction"]
        within = torch.stack([scores[group_ids == g].float().std(unbiased=False) for g in group_ids.unique()])
        print(f"epoch {epoch}: reward {float(scores.mean()):.4f} ± {float(scores.std()):.4f} (std; within a group "
              f"{float(within.mean()):.4f} on average); advantages: mean |A| {float(reward_adv.abs().mean()):.3f}, "
              f"zero-variance groups {zero:.3f}; ‖g‖ reward {float(grads['reward'][-1].norm()):.3e}, random "
              f"{float(grads['random'][-1].norm()):.3e}", flush=True)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    for kind, gs in grads.items():
        pairs = [cos(gs[i], gs[j]) for i, j in itertools.combinations(range(len(gs)), 2)]
        signs = [cos(gs[i].sign(), gs[j].sign()) for i, j in itertools.combinations(range(len(gs)), 2)]
        print(f"{kind}: cosine between epochs' gradients {' '.join(f'{c:+.3f}' for c in pairs)} "
              f"(mean {sum(pairs) / len(pairs):+.3f}); of their signs (Adam's first step) "
              f"{' '.join(f'{c:+.3f}' for c in signs)}")
    same = [cos(a, b) for a, b in zip(grads["reward"], grads["random"])]
    print(f"cosine of the reward and random gradients of the same epoch (epochs 0..{args.epochs - 1}): "
          f"{' '.join(f'{c:+.3f}' for c in same)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
