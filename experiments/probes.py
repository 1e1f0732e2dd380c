"""One online epoch and its policy gradient, outside the training loop: the shared set-up of the one-step probe
(``scripts/probe_one_step.py``) and of the gradient-consistency instrument (``experiments/gradient_consistency.py``).

Both instruments compose a run's config exactly as ``diffalign-train`` would, sample one epoch of groups with the
rollout sampler, score them with the run's first reward, compute the group advantages, and take the gradient of the
method's loss over every trained transition at the current weights — without an optimizer step. The methods covered
are the policy-gradient ones (``data_flow == "online_trajectories"``: DDPO, Flow-GRPO, ViPO); docs/results/learning.md
and docs/results/video.md quote what the two instruments measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffalign.advantages import group_advantages

#: how an epoch's prompts and noise seeds are drawn: ``"online"`` as the online loop's epoch ``epoch`` (the prompts
#: from ``epoch_generator(seed, epoch, PROMPTS)``, group indices ``epoch·P + j``), ``"probe"`` the one-step probe's
#: own draw (a generator seeded ``seed·7919 + epoch``, group indices ``0..P−1``; its figures in the docs use it)
PROMPT_DRAWS = ("online", "probe")


@dataclass
class ProbeSetup:
    """What an instrument needs of a run: its config, policy (LoRA at its initial weights), method, the KL term's
    reference, the first selected reward and the train prompt rows."""

    cfg: Any
    policy: Any
    objective: Any
    reference: Any
    reward: Any
    rows: list[dict]


def compose_run_config(overrides: list[str], output_dir: str):
    """The run config ``diffalign-train <overrides>`` would compose (keys no structured node has refused), with
    ``output_dir`` set to a scratch folder.

    Raises:
        ValueError: an unknown reward name in ``reward=...`` (`diffalign.cli.check_reward_overrides`), or an override
            Hydra cannot apply (an unknown key: Hydra's message).
        ImportError: a ``python:`` reward cannot be imported.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from diffalign.cli import check_reward_overrides
    from diffalign.config.checks import check_structured_keys
    from diffalign.config.compose import CONFIG_DIR, setup_hydra

    setup_hydra()
    check_reward_overrides(overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        try:
            cfg = compose(config_name="train", overrides=[f"output_dir={output_dir}", *overrides])
        except HydraException as err:
            raise ValueError(str(err)) from err
    check_structured_keys(cfg)
    return cfg


def build_probe_setup(cfg) -> ProbeSetup:
    """Builds the policy (after ``torch.manual_seed(cfg.seed)``, as the trainer), the method, its reference (set up
    on the policy, as the online loop does) and the first selected reward.

    Raises:
        ValueError: the method is not a policy-gradient one (DGPO, DiffusionNFT and the offline methods have no
            per-transition loss to probe).
    """
    from hydra.utils import instantiate

    from diffalign.lora.initial import build_policy
    from diffalign.rewards.reward_set import build_selected_rewards
    from diffalign.world.prompts import load_prompts

    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg)
    objective = instantiate(cfg.method)
    if getattr(objective, "data_flow", None) != "online_trajectories":
        raise ValueError(f"method={cfg.method.get('_target_', '?')}: the probes handle the policy-gradient methods "
                         "(DDPO, Flow-GRPO, ViPO), whose data_flow is 'online_trajectories'")
    reference = instantiate(cfg.reference)
    reference.setup(policy)
    rewards = build_selected_rewards(cfg.reward)
    reward = rewards[next(iter(rewards))]
    return ProbeSetup(cfg, policy, objective, reference, reward, load_prompts(cfg.online.get("prompts", "train")))


def epoch_prompt_rows(setup: ProbeSetup, epoch: int, draw: str = "online") -> tuple[list[dict], list[int]]:
    """The prompt rows of one epoch's P groups and their global group indices (which seed the rollouts' noise).

    Raises:
        ValueError: `draw` not in `PROMPT_DRAWS`.
    """
    from diffalign.methods import PROMPTS, epoch_generator

    if draw not in PROMPT_DRAWS:
        raise ValueError(f"draw={draw!r} must be one of {PROMPT_DRAWS}")
    cfg, num_groups = setup.cfg, setup.cfg.online.groups_per_epoch
    if draw == "online":
        generator, groups = epoch_generator(cfg.seed, epoch, PROMPTS), [epoch * num_groups + j for j in range(num_groups)]
    else:
        generator, groups = torch.Generator().manual_seed(cfg.seed * 7919 + epoch), list(range(num_groups))
    pick = torch.randint(len(setup.rows), (num_groups,), generator=generator)
    return [setup.rows[int(i)] for i in pick], groups


@torch.no_grad()
def sample_epoch(setup: ProbeSetup, epoch: int, draw: str = "online"):
    """Samples and scores one epoch's groups at the current weights, as the online loop's steps 1–3.

    Returns:
        `(traj, group_ids, scores, epoch_rows)`: the `Trajectory` of P·G rollouts, their group ids `(P·G,)`, the
        first reward's scores `(P·G,)` float, and the P prompt rows.
    """
    from diffalign.samplers.base import build_sampler
    from diffalign.samplers.groups import group_rollout

    on = setup.cfg.online
    epoch_rows, groups = epoch_prompt_rows(setup, epoch, draw)
    traj, group_ids = group_rollout(
        setup.policy, [r["prompt"] for r in epoch_rows], on.group_size, group_indices=groups, seed=setup.cfg.seed,
        epoch=epoch, shared_initial_noise=on.shared_initial_noise, sampler=build_sampler(setup.cfg.sampler),
        rollout_batch_size=on.rollout_batch_size,
        reduction=getattr(setup.objective, "log_prob_reduction", "mean"))
    metadata = [r for r in epoch_rows for _ in range(on.group_size)]
    scores = setup.reward(traj.images, traj.prompts, metadata).scores.float()
    return traj, group_ids, scores, epoch_rows


def run_advantages(setup: ProbeSetup, scores: torch.Tensor, group_ids: torch.Tensor):
    """Group advantages of `scores` `(N,)` with the run's ``online.advantage_*`` settings
    (`diffalign.advantages.group_advantages`); returns `(advantages (N,), stats)`."""
    on = setup.cfg.online
    return group_advantages(scores, group_ids, std=on.advantage_std, clip=on.advantage_clip,
                            correction=on.advantage_std_correction, eps=on.advantage_eps)


def epoch_gradient(setup: ProbeSetup, traj, advantages: torch.Tensor) -> dict:
    """The gradient of the method's loss, averaged over the transitions one inner epoch trains, at the current
    weights (train mode for the forward, eval mode restored after). The trained transitions are
    ``train_transitions(K, method.timestep_fraction, method.timestep_selection)`` with a generator seeded 0 (one list
    for all rollouts; ``per_sample`` is treated as ``random``), and every rollout is in the loss at once.

    Returns:
        `dict` with ``grads`` (`list[torch.Tensor]`, one per trainable parameter), ``loss`` (`float`, the mean loss over
        the trained transitions), ``steps`` (`list[int]`) and ``prepared`` (what the method's ``prepare_epoch``
        returned, e.g. ViPO's map statistics; `None` for methods without one).
    """
    from diffalign.objectives.policy_gradient import train_transitions

    objective, policy = setup.objective, setup.policy
    prepare = getattr(objective, "prepare_epoch", None)
    prepared = prepare(policy, traj, advantages) if prepare is not None else None
    selection = getattr(objective, "timestep_selection", "random")
    steps = train_transitions(len(traj.timesteps), objective.timestep_fraction,
                              "random" if selection == "per_sample" else selection,
                              generator=torch.Generator().manual_seed(0))
    params = policy.trainable_parameters()
    for prm in params:
        prm.grad = None
    policy.denoiser.train()
    kwargs = {"rows": torch.arange(len(advantages))} if prepare is not None else {}
    total = 0.0
    for k in steps:
        loss, _ = objective(policy, traj, advantages, k, reference=setup.reference, **kwargs)
        (loss / len(steps)).backward()
        total += float(loss.detach()) / len(steps)
    policy.denoiser.eval()
    return {"grads": [prm.grad.detach().clone() for prm in params], "loss": total, "steps": steps,
            "prepared": prepared}
