"""The method contract (diffalign/methods.py): every built-in method declares what the loops read, a method that does
not is refused with a message, and the online methods' plans cover an epoch as the loop used to."""

from __future__ import annotations

import inspect

import pytest
import torch

from diffalign.advantages import EpochAdvantages, PerPromptStatTracker, group_advantages
from diffalign.methods import (
    ONLINE_FLOWS,
    ONLINE_MEMBERS,
    PREFERENCE_FLOWS,
    PREFERENCE_MEMBERS,
    OnlineEpoch,
    check_method,
    split_updates,
)
from diffalign.objectives.ddpo import DDPO
from diffalign.objectives.ddspo import DDSPO
from diffalign.objectives.dgpo import DGPO
from diffalign.objectives.diffusion_dpo import DiffusionDPO
from diffalign.objectives.flow_grpo import FlowGRPO
from diffalign.objectives.grpo_guard import GRPOGuard
from diffalign.objectives.seppo import SePPO
from diffalign.objectives.sft import WinnerSFT
from diffalign.objectives.vipo import ViPO
from diffalign.types import PromptEmbeds, Trajectory

ONLINE = [DGPO, FlowGRPO, GRPOGuard, DDPO, ViPO]
PREFERENCE = [DiffusionDPO, SePPO, WinnerSFT, DDSPO]


@pytest.mark.parametrize("method", ONLINE)
def test_online_methods_declare_the_whole_online_contract(method):
    check_method(method(), method.__name__, ONLINE_FLOWS, ONLINE_MEMBERS, "online")


@pytest.mark.parametrize("method", PREFERENCE)
def test_preference_methods_declare_the_whole_preference_contract(method):
    check_method(method(), method.__name__, PREFERENCE_FLOWS, PREFERENCE_MEMBERS, "preference")
    assert method().checkpoint_states() == {}


def test_a_method_of_the_other_loop_or_without_the_contract_is_refused():
    with pytest.raises(ValueError, match=r"consumes 'pairs' data; the online loop runs methods whose data_flow is one"):
        check_method(DiffusionDPO(), "x.DiffusionDPO", ONLINE_FLOWS, ONLINE_MEMBERS, "online")

    class OldPlugin:  # a method written before the contract
        data_flow = "online_trajectories"

    with pytest.raises(ValueError, match=r"method=p.OldPlugin lacks \['check_config'"):
        check_method(OldPlugin(), "p.OldPlugin", ONLINE_FLOWS, ONLINE_MEMBERS, "online")


def test_what_the_online_methods_declare():
    assert (DGPO.advantage, FlowGRPO().advantage, DDPO().advantage) == ("group", "group", "per_prompt")
    assert (ViPO().advantage, ViPO(advantage_per_reward=True).advantage) == ("group", "per_reward")
    assert ViPO().log_prob_reduction == "per_position" and FlowGRPO.log_prob_reduction == "mean"
    assert DGPO().epoch_updates(2, 3) == 2 and FlowGRPO().epoch_updates(2, 3) == 6
    assert DGPO().checkpoint_states() == {"old_policy_state": None}  # θ⁻ is made by setup(policy)


def test_split_updates_cuts_units_into_contiguous_nearly_equal_updates():
    assert split_updates(list(range(5)), 2) == [[0, 1], [2, 3, 4]]
    assert split_updates([0], 3) == [[0]]  # empty updates are dropped


def epoch(n: int = 8, group_size: int = 4, steps: int = 4, batch_size: int = 4, updates: int = 2, inner: int = 1,
          advantages: torch.Tensor | None = None) -> OnlineEpoch:
    traj = Trajectory(latents=torch.randn(n, steps + 1, 2, 4, 4), timesteps=torch.arange(steps, 0, -1) * 100,
                      log_probs=torch.zeros(n, steps), trainable=torch.ones(steps, dtype=torch.bool),
                      prompt_embeds=PromptEmbeds(torch.randn(n, 3, 8)), images=None,
                      prompts=[f"p{i // group_size}" for i in range(n)], guidance_scale=1.0, noise=1.0)
    return OnlineEpoch(traj, torch.randn(n) if advantages is None else advantages,
                       torch.arange(n) // group_size, group_size, torch.ones(1), seed=0, epoch=0,
                       batch_size=batch_size, updates=updates, inner_epochs=inner, num_processes=1, split="groups",
                       note=print)


def test_dgpo_plans_its_timesteps_times_whole_group_micro_batches():
    plan = list(DGPO(timesteps_per_epoch=2, timestep_max_index=2).plan(None, epoch()))
    assert len(plan) == 2 and sum(len(u) for u in plan) == 2 * 2  # 2 timesteps x 2 micro-batches of 4 rows
    units = [u for update in plan for u in update]
    assert [(u.timestep_index, u.start) for u in units] == [(0, 0), (0, 4), (1, 0), (1, 4)]


def test_policy_gradient_plans_inner_epochs_times_minibatches_times_transitions():
    plan = list(FlowGRPO(timestep_fraction=0.5).plan(None, epoch(inner=2)))
    assert len(plan) == 4  # 2 updates per inner epoch
    units = [u for update in plan for u in update]
    assert len(units) == 2 * 2 * 2  # inner epochs x minibatches x the first 2 of 4 transitions
    assert {u.k for u in units} == {0, 1}
    first_pass = torch.cat([u.rows for u in units[:4:2]])
    assert sorted(first_pass.tolist()) == list(range(8))  # one pass covers every row once


def test_epoch_advantages_by_kind():
    scores, ids = torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.tensor([0, 0, 1, 1])
    prompts = ["a", "a", "b", "b"]
    group = EpochAdvantages("group")(scores, ids, prompts, None)[0]
    assert torch.equal(group, group_advantages(scores, ids)[0])
    tracker = EpochAdvantages("per_prompt", tracker_buffer_size=4, tracker_min_count=2)
    assert torch.equal(tracker(scores, ids, prompts, None)[0],
                       PerPromptStatTracker(4, 2).update(prompts, scores))
    assert tracker.state_dict()["buffers"]["a"] == [1.0, 2.0]
    per_reward = EpochAdvantages("per_reward")(scores, ids, prompts, lambda: torch.stack([scores, -scores], 1))[0]
    assert per_reward.shape == (4, 2) and torch.equal(per_reward[:, 1], -group)
    with pytest.raises(ValueError, match="advantage='x'"):
        EpochAdvantages("x")


# ------------------------------------------------------------------------ a method is built from its config object

def test_every_method_takes_only_its_config_object_or_fields():
    """Each default is written once, in the config dataclass: the constructor is ``(config=None, **fields)`` (that no
    ``configs/method/*.yaml`` repeats one: tests/unit/config/test_structured_configs.py)."""
    from diffalign.objectives.diffusion_nft import DiffusionNFT

    for method in (*ONLINE, *PREFERENCE, DiffusionNFT):
        parameters = list(inspect.signature(method.__init__).parameters.values())
        assert [(p.name, p.kind, p.default) for p in parameters[1:]] == [
            ("config", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
            ("fields", inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty)], method


def test_a_field_set_by_keyword_or_by_config_reaches_the_method():
    from diffalign.objectives.dgpo import DGPOConfig

    by_field, by_config = DGPO(beta=7.0, timesteps_per_epoch=2), DGPO(DGPOConfig(beta=7.0, timesteps_per_epoch=2))
    for method in (by_field, by_config):
        assert (method.beta, method.timesteps_per_epoch, method.old_policy_decay) == (7.0, 2, 0.3)
    assert DGPO(DGPOConfig(beta=7.0), beta=3.0).beta == 3.0  # a keyword wins over the config object's field
    with pytest.raises(TypeError, match=r"^method.betta is not a setting of DGPOConfig; its settings: beta, beta_kl"):
        DGPO(betta=1.0)
    with pytest.raises(TypeError, match="config must be a DGPOConfig, got FlowGRPOConfig"):
        from diffalign.objectives.flow_grpo import FlowGRPOConfig

        DGPO(FlowGRPOConfig())
