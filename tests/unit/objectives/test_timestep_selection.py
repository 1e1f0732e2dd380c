"""``method.timestep_selection=per_sample`` (DDPO, Flow-GRPO, ViPO): each rollout trains its own random subset of its
stored transitions, as the released recipes (ddpo-pytorch ``scripts/train.py``, DanceGRPO/ViPO ``train_*.py``) draw
it, and an update's loss is the mean over its (rollout, transition) pairs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import ONLINE_CASES, compose_cfg, online_overrides

from diffalign.methods import TIMESTEPS, OnlineEpoch, epoch_generator
from diffalign.objectives import policy_gradient
from diffalign.objectives.ddpo import DDPO
from diffalign.objectives.flow_grpo import FlowGRPO
from diffalign.objectives.policy_gradient import per_sample_transitions, train_transitions
from diffalign.objectives.vipo import ViPO
from diffalign.types import PromptEmbeds, Trajectory


def released_pairs(num_rows: int, num_steps: int, timestep_fraction: float, generator: torch.Generator) -> list:
    """The released recipe, written out: ddpo-pytorch scripts/train.py
    ``perms = torch.stack([torch.randperm(num_timesteps) for _ in range(total_batch_size)])`` and
    ``for j in range(num_train_timesteps)`` with ``num_train_timesteps = int(num_timesteps * timestep_fraction)``;
    sample i trains transition perms[i, j] at step j."""
    perms = torch.stack([torch.randperm(num_steps, generator=generator) for _ in range(num_rows)])
    num_train_timesteps = int(num_steps * timestep_fraction)
    return sorted((i, int(perms[i, j])) for i in range(num_rows) for j in range(num_train_timesteps))


def make_epoch(n: int = 8, group_size: int = 4, steps: int = 10, batch_size: int = 4, updates: int = 1,
               inner: int = 1, seed: int = 0, advantages: torch.Tensor | None = None) -> OnlineEpoch:
    # latents[i] hold i everywhere, so a stubbed step can tell which rows it was given
    latents = torch.arange(n, dtype=torch.float32).reshape(n, 1, 1, 1, 1).expand(n, steps + 1, 1, 2, 2).clone()
    traj = Trajectory(latents=latents, timesteps=torch.arange(steps, 0, -1) * 100, log_probs=torch.zeros(n, steps),
                      trainable=torch.ones(steps, dtype=torch.bool), prompt_embeds=PromptEmbeds(torch.zeros(n, 3, 8)),
                      images=None, prompts=[f"p{i // group_size}" for i in range(n)], guidance_scale=1.0, noise=1.0)
    return OnlineEpoch(traj, torch.zeros(n) if advantages is None else advantages, torch.arange(n) // group_size,
                       group_size, torch.ones(1), seed=seed, epoch=0, batch_size=batch_size, updates=updates,
                       inner_epochs=inner, num_processes=1, split="groups", note=print)


def planned_pairs(plan) -> list:
    return sorted((int(r), u.k) for update in plan for u in update for r in u.rows)


@pytest.mark.parametrize("method", [DDPO, FlowGRPO, ViPO])
def test_per_sample_trains_the_released_recipes_randperm_pairs(method):
    for seed in (0, 1):
        ep = make_epoch(seed=seed)
        plan = list(method(timestep_fraction=0.6, timestep_selection="per_sample").plan(None, ep))
        expected = released_pairs(8, 10, 0.6, epoch_generator(seed, 0, TIMESTEPS, 0))
        assert planned_pairs(plan) == expected  # every (row, transition) pair once, the same ones
        assert len(expected) == 8 * 6  # int(10 * 0.6) = 6 per row
    # per sample: the rows' subsets differ (one subset for the batch would give every row the same 6)
    subsets = {frozenset(k for i, k in expected if i == row) for row in range(8)}
    assert len(subsets) > 1
    # a unit holds the rows of one minibatch that train one transition, none empty, at most K units per minibatch
    units = [u for update in plan for u in update]
    assert all(len(u.rows) > 0 for u in units) and len({(u.k, tuple(u.rows.tolist())) for u in units}) == len(units)
    assert len(units) <= 2 * 10


def test_per_sample_draws_each_inner_epoch_from_its_own_stream():
    plan = list(FlowGRPO(timestep_fraction=0.5, timestep_selection="per_sample").plan(None, make_epoch(inner=2)))
    first = [u for u in plan[0]]
    second = [u for u in plan[1]]
    assert planned_pairs([first]) == released_pairs(8, 10, 0.5, epoch_generator(0, 0, TIMESTEPS, 0))
    assert planned_pairs([second]) == released_pairs(8, 10, 0.5, epoch_generator(0, 0, TIMESTEPS, 1))


def test_per_sample_transitions_and_its_errors():
    chosen = per_sample_transitions(3, 4, 0.5, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    assert chosen.tolist() == [torch.randperm(4, generator=g)[:2].tolist() for _ in range(3)]
    assert per_sample_transitions(2, 3, 0.1, torch.Generator().manual_seed(0)).shape == (2, 1)  # at least one
    with pytest.raises(ValueError, match="method.timestep_fraction"):
        per_sample_transitions(2, 4, 1.5)
    # train_transitions is one list for every rollout: it names where per_sample lives
    with pytest.raises(ValueError, match="per_sample_transitions"):
        train_transitions(10, 0.5, "per_sample")
    for method in (DDPO, FlowGRPO, ViPO):
        with pytest.raises(ValueError, match="per_sample"):  # the error lists the choices
            method(timestep_selection="per-sample")


def test_per_sample_update_loss_is_the_mean_over_pairs(monkeypatch):
    # 3 rollouts of one group, K = 2, fraction 0.5: each trains one transition; with rows 0 and 1 at one transition
    # and row 2 at the other, the units hold 2 and 1 rows, and a plain mean over units would weight row 2 double
    delta = torch.tensor([[0.2, -0.3], [0.5, 0.1], [-0.4, 0.3]])  # log pi_theta - log pi_old of row i, transition k
    adv = torch.tensor([1.0, -2.0, 0.5])

    def step(policy, trajectory, k, **kwargs):
        rows = trajectory.latents[:, 0, 0, 0, 0].long()
        return SimpleNamespace(log_prob=delta[rows, k], mean=None, std=None)

    monkeypatch.setattr(policy_gradient, "recompute_step", step)
    clip = 0.25
    objective = FlowGRPO(clip_range=clip, beta_kl=0.0, timestep_fraction=0.5, timestep_selection="per_sample",
                         logprob_check="off")
    for seed in range(6):
        ep = make_epoch(n=3, group_size=3, steps=2, batch_size=3, seed=seed, advantages=adv)
        [update] = list(objective.plan(None, ep))
        # the loop: each unit's loss over the number of units in its update (diffalign/train/online.py, _updates)
        loss = sum(objective.loss(None, u, reference=None)[0] for u in update) / len(update)
        pairs = released_pairs(3, 2, 0.5, epoch_generator(seed, 0, TIMESTEPS, 0))
        # by hand: PPO's max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) per pair, then the plain mean over the 3 pairs
        terms = []
        for i, k in pairs:
            rho, a = math.exp(float(delta[i, k])), float(adv[i])
            terms.append(max(-a * rho, -a * min(max(rho, 1 - clip), 1 + clip)))
        assert float(loss) == pytest.approx(sum(terms) / 3, rel=1e-6)
    # seed 0..5 include an uneven split (2 + 1 rows), where the weights matter
    sizes = set()
    for seed in range(6):
        [update] = list(objective.plan(None, make_epoch(n=3, group_size=3, steps=2, batch_size=3, seed=seed)))
        sizes.add(tuple(sorted(len(u.rows) for u in update)))
    assert (1, 2) in sizes


def test_per_sample_weights_are_one_when_units_are_equal_and_the_defaults_are_unchanged():
    # with fraction 1 every row trains every transition: K units of the whole minibatch, weight 1
    plan = list(DDPO(timestep_fraction=1.0, timestep_selection="per_sample").plan(None, make_epoch(steps=4)))
    assert all(u.weight == 1 and len(u.rows) == 4 for update in plan for u in update)
    # default selections keep weight 1 (their plans are as before)
    for method in (DDPO(timestep_fraction=0.5), FlowGRPO(timestep_fraction=0.5), ViPO()):
        assert all(u.weight == 1 for update in method.plan(None, make_epoch()) for u in update)
    for overrides in (["method=ddpo"], ["method=flow_grpo"], ["method=vipo"]):
        cfg = compose_cfg(overrides + ["method.timestep_selection=per_sample"])
        assert cfg.method.timestep_selection == "per_sample"


def test_the_online_loop_trains_per_sample_pairs(tmp_path, monkeypatch):
    from diffalign.train.online import train

    seen = []
    loss = FlowGRPO.loss

    def spy(self, policy, unit, **kwargs):
        seen.append((unit.rows.tolist(), unit.k, unit.weight))
        return loss(self, policy, unit, **kwargs)

    monkeypatch.setattr(FlowGRPO, "loss", spy)
    cfg = compose_cfg(ONLINE_CASES["flow_grpo_flow"] + online_overrides(tmp_path, epochs=1)
                      + ["method.timestep_selection=per_sample", "method.timestep_fraction=0.5", "seed=3"])
    train(cfg)
    # 2 groups x 4 rollouts, 4 sampler steps, fraction 0.5: int(2.0) = 2 transitions per rollout, one minibatch of 8
    pairs = sorted((r, k) for rows, k, _ in seen for r in rows)
    assert pairs == released_pairs(8, 4, 0.5, epoch_generator(3, 0, TIMESTEPS, 0))
    assert sum(w for _, _, w in seen) == pytest.approx(len(seen))  # the weights average 1 over the update
