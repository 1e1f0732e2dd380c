"""DGPO's edges and wiring that the by-hand loss tests (tests/unit/objectives/test_dgpo_by_hand.py) leave open,
found by mutation testing (docs/contributing.md#mutation-testing): the clip at A = 0 and between the thresholds, what
each forward is given (per-sample timesteps, guidance), the KL metric without β_KL, the group sums across processes,
the argument and config checks with their messages, the defaults of the released code, and `plan` / `loss` /
`setup`.

The clip rule is the released code's (arXiv:2510.08425 repo, docs/methods/algorithms.md#dgpo): with ρ_i =
exp(ℓ_old − ℓ_θ), row i is detached when (A_i > 0 and ρ_i > 1 + ε_c) or (A_i ≤ 0 and ρ_i < 1 − ε_c).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from conftest import OneNumberOldPolicy, OneNumberPolicy, column
from omegaconf import OmegaConf

from diffalign.methods import NOISE, TIMESTEPS, OnlineEpoch, epoch_generator, stream_seed
from diffalign.objectives import dgpo as dgpo_module
from diffalign.objectives.dgpo import DGPO, DGPOConfig, group_noise, group_sums, select_train_timesteps
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.types import GroupBatch, PromptEmbeds, Trajectory


class EmaLikeReference:
    """A reference strategy other than the frozen base (as `EmaReference`): its `use` switches to the "ema" output."""

    def use(self, policy):
        return policy.switched("ema")


def batch_of(advantages, group_ids, group_size=2):
    n = len(advantages)
    return GroupBatch(torch.zeros(n, 1, 1, 1), ["p"] * n, None, torch.tensor(advantages, dtype=torch.float32),
                      torch.tensor(group_ids), group_size)


def call(method, policy, batch, noise, reference=None, **kwargs):
    loss, metrics = method(policy, batch, timesteps=torch.tensor(500.0), noise=column(noise),
                           reference=reference or FrozenBaseReference(), old_policy=OneNumberOldPolicy(), **kwargs)
    (grad,) = torch.autograd.grad(loss, [policy.v])
    return loss.detach(), grad.flatten(), metrics


def test_clip_at_zero_advantage_and_between_the_thresholds_by_hand():
    """ε = 0, ℓθ = v², ℓold = o² (one group, G = 4, β = 4: z = Σ A_i (ℓθ − ℓref) with r = v, so z = 0, σ = ½):

    | i | A   | v | o        | ρ = e^{o² − v²} | clipped (released rule)              |
    |---|-----|---|----------|-----------------|--------------------------------------|
    | 0 | 0.5 | 1 | √1.5     | e^{0.5} ≈ 1.65  | yes: A > 0, ρ > 1.01 (though ρ < 2)  |
    | 1 | 0.5 | 1 | √0.5     | e^{−0.5}        | no: A > 0 is clipped only above      |
    | 2 | 0   | 1 | √0.5     | e^{−0.5}        | yes: A = 0 belongs to A ≤ 0          |
    | 3 | 0   | 1 | √1.5     | e^{0.5}         | no: A ≤ 0 is clipped only below      |

    clipfrac = 2/4; the gradient σ A_i 2 v_i / 4 survives on row 1 only (rows 2, 3 have A = 0)."""
    v, o = [1.0, 1.0, 1.0, 1.0], [math.sqrt(1.5), math.sqrt(0.5), math.sqrt(0.5), math.sqrt(1.5)]
    policy = OneNumberPolicy(v, r=v, o=o)
    loss, grad, metrics = call(DGPO(beta=4.0, clip_range=0.01), policy, batch_of([0.5, 0.5, 0.0, 0.0], [0] * 4, 4),
                               [0.0] * 4)
    assert float(metrics["clipfrac"]) == 0.5
    assert float(loss) == pytest.approx(0.5 * (0.5 + 0.5) / 4, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.5 * 0.5 * 2 / 4, 0.0, 0.0]))


def test_each_forward_gets_per_sample_timesteps_and_its_guidance():
    """A scalar training timestep reaches the policy as `(N,)` (a v-prediction target depends on it), the policy and
    θ⁻ forwards are unguided and the reference forward has `reference_guidance_scale` (DGPO mode 2: 4.5)."""
    policy = OneNumberPolicy([1.0, 2.0], r=[1.0, 1.0])
    call(DGPO(beta=2.0, clip_range=0.01, reference_guidance_scale=4.5), policy, batch_of([1.0, -1.0], [0, 0]),
         [0.0, 0.0])
    assert policy.calls == [("add_noise", (2,), None), ("training_target", (2,), None), ("theta", (2,), 1.0),
                            ("reference", (2,), 4.5), ("old", (2,), 1.0)]


def test_kl_to_the_base_uses_the_reference_guidance_and_is_skipped_without_beta_kl():
    """With an EMA-like DPO reference the KL term needs the base's own forward (guided like the reference); at β_KL = 0
    that forward is skipped and the metric is 0 (`__call__`'s docstring)."""
    v, r = [1.0, 2.0], [1.0, 1.0]
    policy = OneNumberPolicy(v, r=r)
    loss, _, metrics = call(DGPO(beta=2.0, reference_guidance_scale=3.0), policy, batch_of([1.0, -1.0], [0, 0]),
                            [0.0, 0.0], reference=EmaLikeReference())
    assert [c[0] for c in policy.calls if c[0] not in ("add_noise", "training_target")] == ["theta", "ema"]
    assert metrics["kl"].shape == () and float(metrics["kl"]) == 0.0
    # ℓθ = (1, 4), ℓema = ((r + 1)²) = (4, 4): z = (2/2)(1·(1 − 4) − 1·(4 − 4)) = −3; loss = σ(−3)(1·1 − 1·4)/2
    assert float(loss) == pytest.approx(1 / (1 + math.exp(3.0)) * (1 - 4) / 2, rel=1e-6)
    assert float(metrics["loss"]) == float(loss)

    policy = OneNumberPolicy(v, r=r)
    loss_kl, _, metrics = call(DGPO(beta=2.0, beta_kl=0.5, reference_guidance_scale=3.0), policy,
                               batch_of([1.0, -1.0], [0, 0]), [0.0, 0.0], reference=EmaLikeReference())
    assert ("reference", (2,), 3.0) in policy.calls  # the adapter-disabled base, guided
    assert float(metrics["kl"]) == pytest.approx((0 + 1) / 2)  # mean (v − r)²
    assert float(loss_kl) == pytest.approx(float(loss) + 0.5 * 0.5, rel=1e-6)


def test_group_sums_add_the_other_processes_members(monkeypatch):
    """Two processes hold members of groups 3 and 5; this one's partial sums are 1 + 2 (group 3) and 4 (group 5), the
    other's 10 (group 5) and 20 (group 9, absent here): each row gets its group's total over both, in the dtype of
    `values`."""
    other = ([5, 9], [10.0, 20.0])

    def all_gather_object(gathered, mine):
        gathered[0], gathered[1] = mine, other

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    values = torch.tensor([1.0, 4.0, 2.0], dtype=torch.float64)
    sums = group_sums(values, torch.tensor([3, 5, 3]))
    assert sums.dtype == torch.float64
    assert sums.tolist() == [3.0, 14.0, 3.0]


def test_group_sums_on_one_process_keep_the_dtype():
    sums = group_sums(torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64), torch.tensor([1, 1, 2]))
    assert sums.dtype == torch.float64 and sums.tolist() == [0.75, 0.75, 1.0]


def test_group_noise_is_its_own_seeded_stream_not_the_global_rng():
    gids = torch.tensor([4, 4, 6])
    torch.manual_seed(0)
    a = group_noise((2, 3), gids, seed=1, epoch=2, timestep_index=3)
    torch.manual_seed(1)
    b = group_noise((2, 3), gids, seed=1, epoch=2, timestep_index=3)
    assert torch.equal(a, b)
    # the stream of group 6: SeedSequence([seed, epoch, group, timestep index, NOISE]) (diffalign.methods.stream_seed)
    expected = torch.randn((2, 3), generator=torch.Generator().manual_seed(stream_seed(1, 2, 6, 3, NOISE)))
    assert torch.equal(a[2], expected)


def test_timestep_selection_bounds_and_its_own_generator():
    schedule = torch.arange(10, 0, -1) * 100
    assert select_train_timesteps(schedule, 1, 0).tolist() == [1000]  # index 0 alone, one timestep
    assert select_train_timesteps(schedule, 10, 9).tolist() == schedule.tolist()  # all of them, in schedule order
    with pytest.raises(ValueError, match=r"method.timestep_max_index=10 must index the 10-step rollout schedule"):
        select_train_timesteps(schedule, 1, 10)
    with pytest.raises(ValueError, match=r"method.timestep_max_index=-1"):
        select_train_timesteps(schedule, 1, -1)
    with pytest.raises(ValueError, match=r"method.timesteps_per_epoch=0 must be in \[1, timestep_max_index \+ 1 = 5\]"
                       ):
        select_train_timesteps(schedule, 0, 4)
    torch.manual_seed(0)
    a = select_train_timesteps(schedule, 4, 9, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    b = select_train_timesteps(schedule, 4, 9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_defaults_are_the_released_configs():
    """`DGPO()` and `DGPOConfig()` agree field by field, and on the values of docs/methods/algorithms.md#dgpo (β = 100,
    M = 4 timesteps from indices 0..4, θ⁻ = θ for 200 updates, then decay min(0.3, 0.001·step), KL to the base)."""
    method, config = DGPO(), DGPOConfig()
    fields = [f for f in vars(config) if f != "_target_"]
    assert {f: getattr(method, f) for f in fields} == {f: getattr(config, f) for f in fields}
    assert (method.beta, method.beta_kl, method.clip_range, method.reference_guidance_scale) == (100.0, 0.0, None, 1.0)
    assert (method.timesteps_per_epoch, method.timestep_max_index) == (4, 4)
    assert (method.old_policy_switch_step, method.old_policy_decay, method.old_policy_ramp) == (200, 0.3, 0.001)
    assert method.kl_reference == "base"


KL_REFERENCE_MESSAGE = (r"method.kl_reference='ema' must be one of \('base', 'reference'\): 'base' \(the "
                        r"adapter-disabled base, released code\) or 'reference' \(the reference strategy\)")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"beta": 0.0}, r"method.beta=0.0 must be > 0 \(DGPO: 100\)"),
    ({"beta_kl": -0.1}, r"method.beta_kl=-0.1 must be >= 0"),
    ({"clip_range": 0.0}, r"method.clip_range=0.0 must be > 0, or null to disable the clip"),
    ({"reference_guidance_scale": 0.5}, r"method.reference_guidance_scale=0.5 must be >= 1"),
    ({"kl_reference": "ema"}, KL_REFERENCE_MESSAGE),
])
def test_bad_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DGPO(**kwargs)


def test_small_positive_arguments_are_accepted():
    method = DGPO(beta=0.5, beta_kl=0.0, clip_range=1e-3, reference_guidance_scale=1.0)
    assert (method.beta, method.clip_range) == (0.5, 1e-3)


def test_clip_without_a_rollout_policy_is_refused():
    policy = OneNumberPolicy([1.0, 2.0], r=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"^method.clip_range is set but the loop passed no rollout policy θ⁻.$"):
        DGPO(clip_range=0.01)(policy, batch_of([1.0, -1.0], [0, 0]), timesteps=torch.tensor(1.0),
                              noise=column([0.0, 0.0]), reference=FrozenBaseReference())


def run_config(**overrides):
    cfg = {"online": {"best_of_n": None, "group_size": 4, "split": "groups"},
           "sampler": {"name": "dpm_ode", "num_inference_steps": 10},
           "method": {"timestep_max_index": 4, "timesteps_per_epoch": 4}, "trainer": {"batch_size": 8}}
    for key, value in overrides.items():
        section, field = key.split("__")
        cfg[section][field] = value
    return OmegaConf.create(cfg)


CONFIG_ERRORS = {
    "best_of_n": (r"online.best_of_n selects samples for the policy-gradient methods \(DanceGRPO/ViPO\); DGPO trains "
                  r"on whole groups: set online.best_of_n=null"),
    "stochastic": (r"method=dgpo samples its groups with a deterministic ODE solver \(arXiv:2510.08425 §4; "
                   r"docs/methods/algorithms.md#dgpo\), but sampler=flow_sde noise_level=0.7 is stochastic. Use "
                   r"sampler=dpm_ode \(or sampler=euler_ode for flow models\), or sampler=ddim sampler.eta=0 for "
                   r"deterministic DDIM$"),
    "max_index": (r"method.timestep_max_index=10 must index the 10-step rollout schedule; lower it below "
                  r"sampler.num_inference_steps"),
    "timesteps": r"method.timesteps_per_epoch=6 must be in \[1, method.timestep_max_index \+ 1 = 5\]",
    "no_timestep": r"method.timesteps_per_epoch=0 must be in \[1,",
    "groups": (r"trainer.batch_size=6 must be a multiple of online.group_size=4 for DGPO \(a micro-batch holds whole "
               r"groups\)"),
    "members": (r"online.split=members: trainer.batch_size=3 must be a multiple of each process's share of a group "
                r"\(2\) so a micro-batch holds whole shares"),
}


@pytest.mark.parametrize(("overrides", "num_processes", "message"), [
    ({"online__best_of_n": 2}, None, CONFIG_ERRORS["best_of_n"]),
    ({"sampler__name": "flow_sde"}, None, CONFIG_ERRORS["stochastic"]),
    ({"method__timestep_max_index": 10}, None, CONFIG_ERRORS["max_index"]),
    ({"method__timesteps_per_epoch": 6}, None, CONFIG_ERRORS["timesteps"]),
    ({"method__timesteps_per_epoch": 0}, None, CONFIG_ERRORS["no_timestep"]),
    ({"trainer__batch_size": 6}, None, CONFIG_ERRORS["groups"]),
    ({"online__split": "members", "trainer__batch_size": 3}, 2, CONFIG_ERRORS["members"]),
])
def test_config_checks_name_the_field_and_the_fix(overrides, num_processes, message):
    with pytest.raises(ValueError, match=message):
        DGPO.check_config(run_config(**overrides), num_processes)


@pytest.mark.parametrize(("overrides", "num_processes"), [
    ({}, None),
    ({"method__timestep_max_index": 9, "method__timesteps_per_epoch": 10}, None),  # the whole schedule
    ({"method__timestep_max_index": 0, "method__timesteps_per_epoch": 1}, None),
    ({"trainer__batch_size": 4}, None),  # one group per micro-batch
    ({"online__split": "members", "trainer__batch_size": 2}, 2),  # a share of 2 members
    ({"online__split": "members", "trainer__batch_size": 3}, None),  # unchecked before the launch
    ({"online__split": "members", "trainer__batch_size": 3}, 4),  # shares of 1
])
def test_config_checks_accept_the_edges(overrides, num_processes):
    DGPO.check_config(run_config(**overrides), num_processes)


def test_config_without_a_split_means_whole_groups():
    cfg = run_config(trainer__batch_size=6)
    del cfg.online["split"]
    with pytest.raises(ValueError, match="trainer.batch_size=6 must be a multiple of online.group_size=4"):
        DGPO.check_config(cfg)


class EmbedPolicy(OneNumberPolicy):
    """A `OneNumberPolicy` on `(N, 1, 1, 1)` latents with x_t = x_0 + ε·t/1000, predicting v·x_t (θ), r·x_t
    (reference) or o·x_t (θ⁻) plus the mean of the row's prompt embedding; it encodes prompts, with negatives when
    asked (recorded)."""

    def __init__(self):
        super().__init__([1.5], r=[1.0], o=[1.2])
        self.encoded = []

    def encode_prompts(self, prompts, do_classifier_free_guidance=False):
        self.encoded.append((list(prompts), do_classifier_free_guidance))
        n = len(prompts)
        return PromptEmbeds(torch.ones(n, 2, 3), torch.zeros(n, 2, 3) if do_classifier_free_guidance else None)

    def add_noise(self, x0, noise, t):
        super().add_noise(x0, noise, t)
        return x0 + noise * t.reshape(-1, 1, 1, 1) / 1000

    def predict(self, x_t, t, cond, guidance_scale=1.0):
        prompt = cond.prompt_embeds.mean(dim=(1, 2)).view(-1, 1, 1, 1)
        return super().predict(x_t, t, cond, guidance_scale) * x_t + prompt


def online_epoch(n=8, group_size=4, steps=5, batch_size=4, updates=2, negatives=True):
    latents = torch.randn(n, steps + 1, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    embeds = PromptEmbeds(torch.randn(n, 2, 3), torch.randn(n, 2, 3) if negatives else None)
    traj = Trajectory(latents=latents, timesteps=torch.arange(steps, 0, -1) * 100, log_probs=torch.zeros(n, steps),
                      trainable=torch.ones(steps, dtype=torch.bool), prompt_embeds=embeds, images=None,
                      prompts=[f"p{i // group_size}" for i in range(n)], guidance_scale=1.0, noise=0.0)
    advantages = torch.linspace(-1, 1, n)
    return OnlineEpoch(traj, advantages, torch.arange(n) // group_size + 10, group_size, torch.ones(1), seed=3,
                       epoch=1, batch_size=batch_size, updates=updates, inner_epochs=1, num_processes=1,
                       split="groups", note=print)


def test_plan_draws_the_epochs_timesteps_once_and_covers_every_micro_batch():
    epoch = online_epoch()
    method = DGPO(timesteps_per_epoch=2, timestep_max_index=2)
    plan = list(method.plan(EmbedPolicy(), epoch))
    assert [len(update) for update in plan] == [2, 2]  # 2 timesteps x 2 micro-batches, cut into epoch.updates = 2
    units = [u for update in plan for u in update]
    assert [(u.timestep_index, u.start) for u in units] == [(0, 0), (0, 4), (1, 0), (1, 4)]
    chosen = units[0].timesteps
    assert all(torch.equal(u.timesteps, chosen) for u in units)
    assert len(set(chosen.tolist())) == 2 and set(chosen.tolist()) <= {500, 400, 300}  # indices 0..2
    # the epoch's own stream (seed, epoch, TIMESTEPS), whatever the global RNG
    torch.manual_seed(123)
    wide = DGPO(timesteps_per_epoch=2, timestep_max_index=4)
    drawn = next(iter(next(iter(wide.plan(EmbedPolicy(), epoch))))).timesteps
    torch.manual_seed(321)
    again = next(iter(next(iter(wide.plan(EmbedPolicy(), epoch))))).timesteps
    stream = select_train_timesteps(epoch.trajectory.timesteps, 2, 4, generator=epoch_generator(3, 1, TIMESTEPS))
    assert torch.equal(drawn, stream) and torch.equal(again, stream)
    assert all(u.x0 is not None and torch.equal(u.x0, epoch.trajectory.latents[:, -1]) for u in units)
    assert units[0].embeds is epoch.trajectory.prompt_embeds and units[0].epoch is epoch


def test_plan_encodes_the_negatives_only_for_a_guided_reference_that_lacks_them():
    policy = EmbedPolicy()
    units = [u for update in DGPO(reference_guidance_scale=4.5).plan(policy, online_epoch(negatives=False))
             for u in update]
    assert policy.encoded == [([f"p{i // 4}" for i in range(8)], True)]
    assert units[0].embeds.negative_prompt_embeds is not None
    policy = EmbedPolicy()
    list(DGPO(reference_guidance_scale=1.5).plan(policy, online_epoch(negatives=False)))
    assert [cfg for _, cfg in policy.encoded] == [True]  # any guided reference (> 1)
    for scale, negatives in ((4.5, True), (1.0, False)):
        policy = EmbedPolicy()
        list(DGPO(reference_guidance_scale=scale).plan(policy, online_epoch(negatives=negatives)))
        assert policy.encoded == []


def test_loss_of_a_unit_is_the_objective_on_its_rows_timestep_and_group_noise():
    epoch = online_epoch(group_size=2, batch_size=2)
    method = DGPO(beta=3.0, timesteps_per_epoch=2, timestep_max_index=2, clip_range=0.05)
    policy = EmbedPolicy()
    method.rollout_policy = OneNumberOldPolicy()
    units = [u for update in method.plan(policy, epoch) for u in update]
    unit = units[5]  # timestep 1, rows 2..3 (micro-batches of 2 rows start at 0, 2, 4, 6)
    assert (unit.timestep_index, unit.start) == (1, 2)
    loss, metrics = method.loss(policy, unit, reference=FrozenBaseReference())

    rows = slice(2, 4)
    gids = epoch.group_ids[rows]
    noise = group_noise((1, 1, 1), gids, seed=3, epoch=1, timestep_index=1)
    batch = GroupBatch(epoch.trajectory.latents[rows, -1], epoch.trajectory.prompts[rows],
                       epoch.trajectory.prompt_embeds.index(torch.arange(2, 4)), epoch.advantages[rows], gids, 2)
    expected, expected_metrics = method(policy, batch, timesteps=unit.timesteps[1], noise=noise,
                                        reference=FrozenBaseReference(), old_policy=OneNumberOldPolicy())
    assert float(loss) == pytest.approx(float(expected), rel=1e-6) and float(loss) != 0.0
    assert float(metrics["clipfrac"]) == float(expected_metrics["clipfrac"])
    # the group noise, not another draw: the loss with the next timestep index's noise differs
    other = group_noise((1, 1, 1), gids, seed=3, epoch=1, timestep_index=0)
    assert float(method(policy, batch, timesteps=unit.timesteps[1], noise=other, reference=FrozenBaseReference(),
                        old_policy=OneNumberOldPolicy())[0]) != pytest.approx(float(loss), rel=1e-6)


def test_setup_makes_the_rollout_policy_with_the_configured_schedule(monkeypatch):
    made = []

    class FakeRolloutPolicy:
        def __init__(self, switch_step, decay, ramp):
            self.args = (switch_step, decay, ramp)

        def setup(self, policy):
            made.append((self, policy))

    monkeypatch.setattr(dgpo_module, "EmaRolloutPolicy", FakeRolloutPolicy)
    method = DGPO(old_policy_switch_step=7, old_policy_decay=0.2, old_policy_ramp=0.05)
    policy = object()
    method.setup(policy)
    assert method.rollout_policy.args == (7, 0.2, 0.05)
    assert made == [(method.rollout_policy, policy)]
    assert method.checkpoint_states() == {"old_policy_state": method.rollout_policy}
