"""ViPO's plumbing around the loss (issue 35: the survivors and untested functions of ``python scripts/mutation.py
objectives/vipo``): the map statistics, decoding the rollouts when they kept no images, the advantage clip, maps made
on the fly without ``rows``, and the `prepare` / `plan` / `loss` contract the online loop calls."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from conftest import step_sampler

from diffalign.methods import OnlineEpoch
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.policy_gradient import TransitionUnit, transition_plan
from diffalign.objectives.vipo import ViPO
from diffalign.samplers.rollout import rollout

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a blue square"]


@pytest.fixture(scope="module")
def policy_and_rollout():
    policy = build_tiny_random_policy(seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=1.0),
                   generator=gens, reduction="per_position")
    return policy, traj


class RecordingBackbone:
    """Patch tokens of random structure (sample 0 poisoned with a NaN, so its map falls back to ones); keeps the
    images it was given."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []

    def patch_tokens(self, images):
        self.seen.append(images.detach().clone())
        out = torch.randn(len(images), 8, 8, 16, generator=torch.Generator().manual_seed(0))
        out[0, 0, 0, 0] = float("nan")
        return out


def epoch_of(traj, advantages, reward_weights=None) -> OnlineEpoch:
    n = len(traj.prompts)
    reward_weights = torch.ones(1) if reward_weights is None else reward_weights
    return OnlineEpoch(traj, advantages, torch.arange(n) // 2, 2, reward_weights, seed=3, epoch=1, batch_size=2,
                       updates=2, inner_epochs=1, num_processes=1, split="groups", note=print)


def test_all_ones_map_statistics(policy_and_rollout):
    policy, traj = policy_and_rollout
    vipo = ViPO(map="ones")
    assert vipo.prepare_epoch(policy, traj, torch.ones(4)) == {"map_mean": 1.0, "map_fallback": 0.0}


def test_psm_statistics_and_decoding_when_the_rollout_kept_no_images(policy_and_rollout):
    policy, traj = policy_and_rollout
    backbone = RecordingBackbone()
    vipo = ViPO(backbone=backbone)
    stats = vipo.prepare_epoch(policy, dataclasses.replace(traj, images=None), torch.ones(4))
    with torch.no_grad():
        decoded = policy.decode(traj.latents[:, -1])  # the final latents x_0
    assert torch.equal(backbone.seen[-1], decoded)
    assert stats == {"map_mean": float(vipo.maps.mean()), "map_fallback": 0.25}  # one sample of four fell back
    assert torch.equal(vipo.maps[0], torch.ones_like(vipo.maps[0])) and vipo.maps[1].min() == 0
    vipo.prepare_epoch(policy, traj, torch.ones(4))  # with images: those are used, not decoded again
    assert torch.equal(backbone.seen[-1], traj.images)


def test_advantage_clip_reaches_the_maps(policy_and_rollout):
    """A = (3, −3, 8, 0.5) on an all-ones map, clipped at 2 (and at the default 5)."""
    policy, traj = policy_and_rollout
    adv = torch.tensor([3.0, -3.0, 8.0, 0.5])
    vipo = ViPO(map="ones", advantage_clip=2.0)
    vipo.prepare_epoch(policy, traj, adv)
    assert vipo.advantage_maps.flatten(1).mean(1).tolist() == [2.0, -2.0, 2.0, 0.5]
    vipo = ViPO(map="ones")
    vipo.prepare_epoch(policy, traj, adv)
    assert vipo.advantage_maps.flatten(1).mean(1).tolist() == [3.0, -3.0, 5.0, 0.5]


def test_without_rows_the_maps_are_made_for_the_minibatch(policy_and_rollout):
    """Before any update the ratio is 1, so the loss is −mean A^p: A = (3, −1, 0, 0) clipped at 2 gives
    −(2 − 1) / 4 = −0.25 — also after `prepare_epoch` with other advantages, since no ``rows`` were given."""
    policy, traj = policy_and_rollout
    vipo = ViPO(map="ones", advantage_clip=2.0)
    adv = torch.tensor([3.0, -1.0, 0.0, 0.0])
    loss, _ = vipo(policy, traj, adv, 1)
    torch.testing.assert_close(loss, torch.tensor(-0.25), rtol=1e-4, atol=1e-5)
    vipo.prepare_epoch(policy, traj, torch.ones(4))
    loss, _ = vipo(policy, traj, adv, 1)
    torch.testing.assert_close(loss, torch.tensor(-0.25), rtol=1e-4, atol=1e-5)


def test_prepare_plan_and_loss_as_the_training_loop_calls_them(policy_and_rollout):
    policy, traj = policy_and_rollout
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    vipo = ViPO(map="ones", timestep_fraction=0.6, timestep_selection="per_sample")
    epoch = epoch_of(traj, adv)
    assert vipo.prepare(policy, epoch) == {"vipo/map_mean": 1.0, "vipo/map_fallback": 0.0}
    torch.testing.assert_close(vipo.advantage_maps.flatten(1).mean(1), adv)
    planned = [[(u.rows.tolist(), u.k, u.weight) for u in update] for update in vipo.plan(policy, epoch)]
    expected = [[(u.rows.tolist(), u.k, u.weight) for u in update] for update in transition_plan(epoch, 0.6,
                                                                                                   "per_sample")]
    assert planned == expected and len(planned) == 2
    unit = TransitionUnit(epoch, torch.tensor([2, 0]), 1, weight=0.5)
    loss, metrics = vipo.loss(policy, unit, reference=None)
    # ratio 1: 0.5 · −mean(A_2, A_0) = 0.5 · −(0.5 + 1) / 2
    torch.testing.assert_close(loss, torch.tensor(-0.375), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(metrics["loss"], torch.tensor(-0.75), rtol=1e-4, atol=1e-5)


def test_prepare_with_one_advantage_per_reward_takes_the_reward_weights(policy_and_rollout):
    policy, traj = policy_and_rollout
    vipo = ViPO(map="ones", advantage_per_reward=True)
    weights = torch.tensor([0.25, 2.0])
    vipo.prepare(policy, epoch_of(traj, torch.ones(4, 2), reward_weights=weights))
    assert torch.equal(vipo.reward_coefficients, weights)
    # Σ_r c_r 𝓛_r with ratio 1: −(0.25 · mean A_1 + 2 · mean A_2) for A_1 = 1, A_2 = −1 on every row
    vipo.prepare_epoch(policy, traj, torch.stack([torch.ones(4), -torch.ones(4)], 1))
    loss, _ = vipo(policy, traj, torch.stack([torch.ones(4), -torch.ones(4)], 1), 0, rows=torch.arange(4))
    torch.testing.assert_close(loss, torch.tensor(-(0.25 * 1 + 2.0 * -1)), rtol=1e-4, atol=1e-5)


def test_prepare_and_the_minibatch_maps_decode_with_the_policy(policy_and_rollout):
    """Without stored images `prepare` (and a call without ``rows``) decode the final latents with the policy: the
    PSM sees ``policy.decode(x_0)`` of the rows it maps."""
    policy, traj = policy_and_rollout
    no_images = dataclasses.replace(traj, images=None)
    with torch.no_grad():
        decoded = policy.decode(traj.latents[:, -1])
    backbone = RecordingBackbone()
    vipo = ViPO(backbone=backbone)
    stats = vipo.prepare(policy, epoch_of(no_images, torch.ones(4)))
    assert torch.equal(backbone.seen[-1], decoded) and stats["vipo/map_fallback"] == 0.25
    vipo = ViPO(backbone=backbone)
    vipo(policy, no_images.index(torch.tensor([1, 3])), torch.ones(2), 1)
    assert torch.equal(backbone.seen[-1], decoded[[1, 3]])


def test_the_consistency_alarm_checks_vipos_per_position_log_probs(policy_and_rollout):
    """During an epoch's first update a stored per-position log-prob off by 0.5 (> the tolerance 0.1) stops the run,
    naming the epoch and the transition trained."""
    from types import SimpleNamespace

    from diffalign.runtime.faults import RolloutMismatchError

    policy, traj = policy_and_rollout
    log_probs = traj.log_probs.clone()
    log_probs[2, 1, 0, 0] += 0.5
    shifted = dataclasses.replace(traj, log_probs=log_probs)
    vipo = ViPO(map="ones", logprob_tolerance=0.1)
    updates = vipo.checked_updates(SimpleNamespace(epoch=6), iter([["update 0"], ["update 1"]]))
    next(updates)
    vipo(policy, shifted, torch.ones(4), 0)  # transition 0 matches
    with pytest.raises(RolloutMismatchError, match=r"before the first update of epoch 6 \(transition 1\): max "
                       r"\|Δ log π\| = 0\.5 > method\.logprob_tolerance=0\.1 "):
        vipo(policy, shifted, torch.ones(4), 1)


def test_per_reward_advantages_without_their_coefficients_are_refused(policy_and_rollout):
    policy, traj = policy_and_rollout
    vipo = ViPO(map="ones", advantage_per_reward=True)
    with pytest.raises(ValueError, match="^2 per-reward advantages need 2 reward_coefficients; the training loop sets "
                       r"them from reward\.<name>\.weight$"):
        vipo(policy, traj, torch.ones(4, 2), 0)
    vipo.reward_coefficients = torch.ones(3)
    with pytest.raises(ValueError, match="^2 per-reward advantages need 2 reward_coefficients"):
        vipo(policy, traj, torch.ones(4, 2), 0)


def test_metrics_by_hand(policy_and_rollout):
    """Stored log-probs set to log π_θ − d per position (d = 0.2 at one position of each sample, else 0), A = (1, −2,
    0.5, 3) on an all-ones map, ε = 0.1: ratio = mean exp(d), clipfrac = the share of positions with |exp(d) − 1| > ε,
    approx_kl = mean ½ d², adv_map_abs = mean |A^p| — the released ViPO/DanceGRPO logging."""
    from diffalign.samplers.rollout import recompute_step

    policy, traj = policy_and_rollout
    k = 1
    with torch.no_grad():
        now = recompute_step(policy, traj, k, reduction="per_position", detach_unconditional=True).log_prob
    d = torch.zeros_like(now)
    d[:, 0, 0] = 0.2
    log_probs = traj.log_probs.clone()
    log_probs[:, k] = now - d
    shifted = dataclasses.replace(traj, log_probs=log_probs)
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    vipo = ViPO(map="ones", clip_range=0.1)
    loss, metrics = vipo(policy, shifted, adv, k)
    positions = d[0].numel()
    assert set(metrics) == {"loss", "ratio", "clipfrac", "approx_kl", "adv_map_abs"}
    torch.testing.assert_close(metrics["loss"], loss.detach())
    ratio = (positions - 1 + torch.exp(torch.tensor(0.2))) / positions
    torch.testing.assert_close(metrics["ratio"], ratio, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(1 / positions))
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(0.5 * 0.2 ** 2 / positions), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(metrics["adv_map_abs"], torch.tensor((1 + 2 + 0.5 + 3) / 4))


def test_the_psm_maps_the_stored_images_and_mismatched_log_probs_are_named(policy_and_rollout):
    policy, traj = policy_and_rollout
    backbone = RecordingBackbone()
    stored = 1 - traj.images  # not what decoding would give: the stored ones are used as they are
    ViPO(backbone=backbone).prepare_epoch(policy, dataclasses.replace(traj, images=stored), torch.ones(4))
    assert torch.equal(backbone.seen[-1], stored)
    # log-probs stored on another grid (here (B, K, 1, 1), which broadcasts) under reduction=per_position
    other_grid = dataclasses.replace(traj, log_probs=traj.log_probs.mean((2, 3), keepdim=True))
    grid = tuple(traj.latents.shape[3:])
    with pytest.raises(ValueError, match="^" + re.escape(
            f"per-position log-probs (4, 1, 1) do not match the advantage maps (4, {grid[0]}, {grid[1]}); the rollout must "
            "use reduction='per_position'.") + "$"):
        ViPO(map="ones", logprob_check="off")(policy, other_grid, torch.ones(4), 0)


def test_config_object_bounds_and_messages():
    """Every refusal of `ViPO.__init__` with its exact message, and the edges that are allowed."""
    from diffalign.objectives.vipo import ViPOConfig

    assert ViPO(ViPOConfig(clip_range=0.3, map="ones")).clip_range == 0.3  # the config object is used
    edges = ViPO(timestep_fraction=1.0, spatial_sigma=0.0, temporal_sigma=0.0, advantage_clip=0.5)
    assert (edges.timestep_fraction, edges.advantage_clip) == (1.0, 0.5)
    assert ViPO(advantage_clip=None).advantage_clip is None
    assert ViPO(map="ones", backbone="not a backbone").map == "ones"  # the backbone is checked for the PSM only
    refused = [
        ({"timestep_fraction": 1.5}, "method.timestep_fraction=1.5 must be in (0, 1]."),
        ({"timestep_selection": "last"},
         "method.timestep_selection='last' must be one of ('first', 'random', 'per_sample')."),
        ({"spatial_sigma": -1.0},
         "method.spatial_sigma=-1.0 and method.temporal_sigma=0.3 must be >= 0 (0: no smoothing)."),
        ({"temporal_sigma": -0.5},
         "method.spatial_sigma=1.0 and method.temporal_sigma=-0.5 must be >= 0 (0: no smoothing)."),
        ({"advantage_clip": 0.0}, "method.advantage_clip=0.0 must be > 0 (5 in the released code) or null."),
        ({"backbone": "not a backbone"},
         "method.backbone='not a backbone' must be 'tiny_clip', 'dinov2:<folder>' or 'python:<module>:<factory>'"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            ViPO(**fields)


def test_before_the_first_epoch(policy_and_rollout):
    """No maps, statistics or coefficients before `prepare`; the advantage the loop computes ("group", or "per_reward"
    with advantage_per_reward); rows given before any `prepare_epoch` make the minibatch's maps."""
    policy, traj = policy_and_rollout
    vipo = ViPO(map="ones", advantage_clip=2.0)
    assert (vipo.maps, vipo.advantage_maps, vipo.map_stats, vipo.reward_coefficients) == (None, None, {}, None)
    assert vipo.advantage == "group" and ViPO(map="ones", advantage_per_reward=True).advantage == "per_reward"
    loss, _ = vipo(policy, traj.index(torch.tensor([0, 1])), torch.tensor([3.0, -1.0]), 1, rows=torch.tensor([0, 1]))
    torch.testing.assert_close(loss, torch.tensor(-(2.0 - 1.0) / 2), rtol=1e-4, atol=1e-5)


def test_loss_uses_the_epochs_maps_without_mapping_again(policy_and_rollout):
    """`loss` passes the unit's rows, so the maps `prepare` made are used: the backbone is not run again (the PSM runs
    once per epoch); before any `prepare` the unit's own advantages make the minibatch's maps."""
    policy, traj = policy_and_rollout
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    epoch = epoch_of(traj, adv)
    backbone = RecordingBackbone()
    vipo = ViPO(backbone=backbone)
    vipo.prepare(policy, epoch)
    assert len(backbone.seen) == 1
    unit = TransitionUnit(epoch, torch.tensor([3, 1]), 0, weight=1.0)
    loss, _ = vipo.loss(policy, unit, reference=None)
    assert len(backbone.seen) == 1
    # ratio 1: −mean over the rows' positions of M·A (the maps of rows 3 and 1 from the epoch)
    expected = -(vipo.advantage_maps[[3, 1]]).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)
    fresh = ViPO(map="ones")
    loss, _ = fresh.loss(policy, unit, reference=None)
    torch.testing.assert_close(loss, torch.tensor(-(-0.5 - 1.0) / 2), rtol=1e-4, atol=1e-5)
