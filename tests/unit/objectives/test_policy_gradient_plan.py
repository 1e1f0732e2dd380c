"""The policy-gradient epoch plan (`trajectory_minibatches`, `transition_plan`) beyond what the timestep-selection
tests pin, found by mutation testing (docs/contributing.md#mutation-testing): the stratified minibatches reproduce a
run on fewer processes (the docstring's claim), the fallback shuffle, the trainable window's indices, the multi-process
notes, and the error without a trainable step."""

from __future__ import annotations

import pytest
import torch

from diffalign.methods import SHUFFLE, TIMESTEPS, OnlineEpoch, epoch_generator, stream_seed
from diffalign.objectives.policy_gradient import train_transitions, trajectory_minibatches, transition_plan
from diffalign.types import PromptEmbeds, Trajectory


def shares(minibatches, rows):
    """Each minibatch's members among `rows`, as positions in `rows`."""
    return [[rows.index(i) for i in mb.tolist() if i in rows] for mb in minibatches]


def test_stratified_minibatches_take_k_members_of_every_group_and_cover_each_row_once():
    ids = torch.tensor([5, 5, 5, 5, 9, 9, 9, 9])
    minibatches, stratified = trajectory_minibatches(ids, 4, seed=1, epoch=2, inner=0)
    assert stratified and len(minibatches) == 2
    assert all(sorted(ids[mb].tolist()) == [5, 5, 9, 9] for mb in minibatches)  # k = 4 / 2 groups = 2 each
    assert sorted(torch.cat(minibatches).tolist()) == list(range(8))
    assert all(mb.dtype == torch.int64 for mb in minibatches)


def test_a_process_with_one_group_gets_that_groups_share_of_the_one_process_minibatches():
    """One process with groups 5 and 9 (batch 4) vs two processes holding one group each (batch 2): process 0's
    minibatch m is group 5's part of the one-process minibatch m, member for member; the same for group 9."""
    both, _ = trajectory_minibatches(torch.tensor([5, 5, 5, 5, 9, 9, 9, 9]), 4, seed=1, epoch=2, inner=1)
    only_5, stratified = trajectory_minibatches(torch.tensor([5, 5, 5, 5]), 2, seed=1, epoch=2, inner=1)
    only_9, _ = trajectory_minibatches(torch.tensor([9, 9, 9, 9]), 2, seed=1, epoch=2, inner=1)
    assert stratified
    assert shares(both, [0, 1, 2, 3]) == [mb.tolist() for mb in only_5]
    assert shares(both, [4, 5, 6, 7]) == [mb.tolist() for mb in only_9]
    # each inner epoch, epoch and seed shuffles anew (the members' stream is keyed by all of them)
    draws = {tuple(torch.cat(trajectory_minibatches(torch.tensor([5] * 8), 2, seed=s, epoch=e, inner=i)[0]).tolist())
             for s, e, i in ((1, 2, 1), (0, 2, 1), (1, 3, 1), (1, 2, 0))}
    assert len(draws) == 4
    # the streams the docstring names: group g's members by SeedSequence([seed, epoch, g, inner, SHUFFLE])
    order_9 = torch.randperm(4, generator=torch.Generator().manual_seed(stream_seed(1, 2, 9, 1, SHUFFLE))).tolist()
    assert [i for mb in only_9 for i in mb.tolist()] == order_9


@pytest.mark.parametrize(("ids", "batch_size"), [
    ([0, 0, 0, 1, 1], 2),  # groups of different sizes
    ([0, 0, 0, 1, 1, 1], 4),  # k = 2 members per group does not divide the group size 3
    ([0, 0, 1, 1, 2, 2], 4),  # 4 rows are not a whole number of members from each of 3 groups
])
def test_other_batches_fall_back_to_a_local_shuffle_in_chunks(ids, batch_size):
    minibatches, stratified = trajectory_minibatches(torch.tensor(ids), batch_size, seed=0, epoch=0, inner=0)
    assert not stratified
    sizes = [len(mb) for mb in minibatches]
    assert sizes[:-1] == [batch_size] * (len(sizes) - 1) and sum(sizes) == len(ids)
    assert sorted(torch.cat(minibatches).tolist()) == list(range(len(ids)))
    again, _ = trajectory_minibatches(torch.tensor(ids), batch_size, seed=0, epoch=0, inner=0)
    assert all(torch.equal(a, b) for a, b in zip(minibatches, again))
    # one permutation of the process's rows from the stream keyed by (seed, epoch, inner)
    perm = torch.randperm(len(ids), generator=epoch_generator(0, 0, SHUFFLE, 0))
    assert torch.equal(torch.cat(minibatches), perm)
    for seed, epoch, inner in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
        other, _ = trajectory_minibatches(torch.tensor(ids), batch_size, seed=seed, epoch=epoch, inner=inner)
        assert torch.equal(torch.cat(other), torch.randperm(len(ids), generator=epoch_generator(seed, epoch, SHUFFLE,
                                                                                                 inner)))


def plan_epoch(trainable, n=8, group_size=4, batch_size=4, inner=1, processes=1, split="groups", notes=None):
    steps = len(trainable)
    traj = Trajectory(latents=torch.zeros(n, steps + 1, 1, 2, 2), timesteps=torch.arange(steps, 0, -1) * 100,
                      log_probs=torch.zeros(n, steps), trainable=torch.tensor(trainable),
                      prompt_embeds=PromptEmbeds(torch.zeros(n, 2, 3)), images=None,
                      prompts=[f"p{i // group_size}" for i in range(n)], guidance_scale=1.0, noise=1.0,
                      sampler="window_sde")
    return OnlineEpoch(traj, torch.zeros(n), torch.arange(n) // group_size, group_size, torch.ones(1), seed=0, epoch=0,
                       batch_size=batch_size, updates=1, inner_epochs=inner, num_processes=processes, split=split,
                       note=(notes.append if notes is not None else print))


def test_a_window_trains_its_own_step_indices():
    """Trainable steps 1 and 2 of 4 (MixGRPO's window): "first" with fraction 1 trains transitions 1 and 2, and
    "per_sample" only those too."""
    units = [u for update in transition_plan(plan_epoch([False, True, True, False]), 1.0, "first") for u in update]
    assert sorted({u.k for u in units}) == [1, 2] and len(units) == 2 * 2  # 2 minibatches x 2 transitions
    per_sample = [u for update in transition_plan(plan_epoch([False, True, True, False]), 0.5, "per_sample")
                  for u in update]
    assert {u.k for u in per_sample} <= {1, 2} and sum(len(u.rows) for u in per_sample) == 8  # one each (⌊2·0.5⌋)
    assert len(transition_plan_units(plan_epoch([True] * 4, inner=3), 0.5, "first")) == 3 * 2 * 2


def transition_plan_units(epoch, fraction, selection):
    return [u for update in transition_plan(epoch, fraction, selection) for u in update]


def test_no_trainable_step_is_refused_naming_the_sampler():
    with pytest.raises(ValueError, match=r"^the epoch's rollouts \(sampler=window_sde\) have no step with a log-prob "
                                         r"to train$"):
        transition_plan_units(plan_epoch([False] * 4), 1.0, "first")


def test_notes_on_several_processes():
    notes: list[str] = []
    transition_plan_units(plan_epoch([True] * 4, processes=2, split="members", batch_size=3, notes=notes), 0.5,
                          "per_sample")
    assert notes == [
        ("[diffalign] note: method.timestep_selection=per_sample draws each process's rows' transitions on their own "
         "(by local row index), so a run on another number of processes will differ"),
        ("[diffalign] note: online.split=members with a policy-gradient method shuffles each process's share of a "
         "group on its own; a run on another number of processes will differ (online.split=groups reproduces it)"),
        ("[diffalign] note: trainer.batch_size=3 is not a whole number of members from each of a process's groups, so "
         "minibatches are shuffled per process (a run on another number of processes will differ)"),
    ]
    quiet: list[str] = []
    transition_plan_units(plan_epoch([True] * 4, processes=1, split="members", batch_size=3, notes=quiet), 0.5,
                          "per_sample")
    transition_plan_units(plan_epoch([True] * 4, processes=2, notes=quiet), 0.5, "first")  # stratified, groups
    assert quiet == []


def test_random_transitions_come_from_the_epochs_stream_and_units_carry_their_rows():
    """"random": the trained transitions are `train_transitions`' draw from the pass's own stream (seed, epoch,
    TIMESTEPS, inner), whatever the global RNG; every unit holds its epoch and one minibatch's rows."""
    epoch = plan_epoch([True] * 6, inner=2)
    torch.manual_seed(0)
    units = transition_plan_units(epoch, 0.5, "random")
    torch.manual_seed(1)
    again = transition_plan_units(epoch, 0.5, "random")
    assert [(u.rows.tolist(), u.k) for u in units] == [(u.rows.tolist(), u.k) for u in again]
    for inner in range(2):
        expected = train_transitions(6, 0.5, "random", generator=epoch_generator(0, 0, TIMESTEPS, inner))
        minibatches, _ = trajectory_minibatches(epoch.group_ids, 4, seed=0, epoch=0, inner=inner)
        pass_units = units[inner * 2 * 3:(inner + 1) * 2 * 3]  # 2 minibatches x 3 transitions per pass
        assert [(u.rows.tolist(), u.k) for u in pass_units] == [(mb.tolist(), k) for mb in minibatches
                                                                  for k in expected]
    assert all(u.epoch is epoch and u.weight == 1.0 for u in units)
