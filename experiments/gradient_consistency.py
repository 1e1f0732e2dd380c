"""Is a policy-gradient method's update direction consistent from epoch to epoch, with the real reward and with
random scores?

Composes a run's config as ``diffalign-train`` would (recipe + overrides) and, at the base weights, for each of
``--epochs`` epochs (the online loop's prompts and seeds of that epoch): samples the epoch's groups, scores them, and
takes the method's gradient over every trained transition twice — with the group advantages of the real reward, and
with those of random scores (standard normal per rollout, normalised in each group the same way). It prints the
cosine between every pair of epochs' gradients for each kind, and between the real and random gradient of the same
epoch.

Reading: random advantages give gradients with cosine ≈ 0 between epochs (n Adam steps then move the weights about
√n steps' worth); a reward whose gradient has a component that repeats from epoch to epoch (signal, or a bias of the
credit assignment) gives cosines > 0 and moves the weights about n steps' worth.

    python experiments/gradient_consistency.py recipe=tiny_vipo_video method.map=ones method.reduction=scalar_weighted
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
    args = p.parse_args()
    if args.epochs < 2:
        raise SystemExit(f"--epochs {args.epochs}: at least 2 epochs are needed to compare gradients")

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from diffalign.advantages import group_advantages
    from diffalign.cli import CONFIG_DIR, _setup, check_reward_overrides
    from diffalign.deprecation import migrate_config
    from diffalign.init_lora import build_policy
    from diffalign.methods import PROMPTS, epoch_generator
    from diffalign.objectives.policy_gradient import train_transitions
    from diffalign.plugins import build_selected_rewards
    from diffalign.samplers.groups import group_rollout
    from diffalign.world.prompts import load_prompts

    _setup()
    check_reward_overrides(args.overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/gradient_consistency", *args.overrides])
    migrate_config(cfg, args.overrides)
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg)
    objective = instantiate(cfg.method)
    if not hasattr(objective, "timestep_fraction"):
        raise SystemExit("the script handles policy-gradient methods (DDPO, Flow-GRPO, ViPO)")
    reference = instantiate(cfg.reference)
    reference.setup(policy)
    rewards = build_selected_rewards(cfg.reward)
    reward = rewards[next(iter(rewards))]  # the first selected reward, as probe_one_step.py
    on, sp = cfg.online, cfg.sampler
    rows = load_prompts(on.get("prompts", "train"))
    params = policy.trainable_parameters()

    def gradient(traj, advantages) -> torch.Tensor:
        prepare = getattr(objective, "prepare_epoch", None)
        if prepare is not None:
            prepare(policy, traj, advantages)
        steps = train_transitions(len(traj.timesteps), objective.timestep_fraction,
                                  getattr(objective, "timestep_selection", "random"),
                                  generator=torch.Generator().manual_seed(0))
        for prm in params:
            prm.grad = None
        policy.denoiser.train()
        for k in steps:
            kwargs = {"rows": torch.arange(len(advantages))} if prepare is not None else {}
            loss, _ = objective(policy, traj, advantages, k, reference=reference, **kwargs)
            (loss / len(steps)).backward()
        policy.denoiser.eval()
        return torch.cat([prm.grad.detach().flatten().clone() for prm in params])

    grads: dict[str, list[torch.Tensor]] = {"reward": [], "random": []}
    for epoch in range(args.epochs):
        pick = torch.randint(len(rows), (on.groups_per_epoch,), generator=epoch_generator(cfg.seed, epoch, PROMPTS))
        epoch_rows = [rows[int(i)] for i in pick]
        with torch.no_grad():
            traj, group_ids = group_rollout(
                policy, [r["prompt"] for r in epoch_rows], on.group_size,
                group_indices=[epoch * on.groups_per_epoch + j for j in range(on.groups_per_epoch)], seed=cfg.seed,
                epoch=epoch, shared_initial_noise=on.shared_initial_noise, sampler=sp.name,
                num_inference_steps=sp.num_inference_steps, guidance_scale=sp.guidance_scale, eta=sp.get("eta", 0.0),
                noise_level=sp.get("noise_level", 0.0), rollout_batch_size=on.rollout_batch_size,
                reduction=getattr(objective, "log_prob_reduction", "mean"))
        scores = reward(traj.images, traj.prompts, [r for r in epoch_rows for _ in range(on.group_size)]).scores.float()
        noise = torch.randn(len(scores), generator=torch.Generator().manual_seed(1000 + epoch))
        for kind, s in (("reward", scores), ("random", noise)):
            adv, _ = group_advantages(s, group_ids, std=on.advantage_std, clip=on.advantage_clip,
                                          correction=on.advantage_std_correction, eps=on.advantage_eps)
            grads[kind].append(gradient(traj, adv))
        print(f"epoch {epoch}: reward {float(scores.mean()):.4f} ± {float(scores.std()):.4f} (std); "
              f"‖g‖ reward {float(grads['reward'][-1].norm()):.3e}, random {float(grads['random'][-1].norm()):.3e}",
              flush=True)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    for kind, gs in grads.items():
        pairs = [cos(gs[i], gs[j]) for i, j in itertools.combinations(range(len(gs)), 2)]
        signs = [cos(gs[i].sign(), gs[j].sign()) for i, j in itertools.combinations(range(len(gs)), 2)]
        print(f"{kind}: cosine between epochs' gradients {' '.join(f'{c:+.3f}' for c in pairs)} "
              f"(mean {sum(pairs) / len(pairs):+.3f}); of their signs (Adam's first step) "
              f"{' '.join(f'{c:+.3f}' for c in signs)}")
    same = [cos(a, b) for a, b in zip(grads["reward"], grads["random"])]
    print(f"reward vs random, same epoch: {' '.join(f'{c:+.3f}' for c in same)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
