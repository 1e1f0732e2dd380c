"""`FlowGRPO` is built from `FlowGRPOConfig`, the one place its released defaults are written: every field reaches the
objective, from the defaults, from a config object and from keyword fields (found by mutation testing,
docs/contributing.md#mutation-testing: dropped arguments fell back to `ClippedPolicyGradient`'s own defaults)."""

from __future__ import annotations

from diffalign.objectives.flow_grpo import FlowGRPO, FlowGRPOConfig

FIELDS = ("clip_range", "beta_kl", "kl_form", "detach_unconditional", "timestep_fraction", "timestep_selection",
          "logprob_check", "logprob_tolerance")


def test_every_config_field_reaches_the_objective():
    method = FlowGRPO()
    assert {f: getattr(method, f) for f in FIELDS} == {f: getattr(FlowGRPOConfig(), f) for f in FIELDS}
    assert (method.beta_kl, method.detach_unconditional, method.advantage) == (0.04, True, "group")
    changed = FlowGRPOConfig(clip_range=0.2, beta_kl=0.5, kl_form="exact", detach_unconditional=False,
                             timestep_fraction=0.5, timestep_selection="random", logprob_check="warn",
                             logprob_tolerance=0.25)
    from_config = FlowGRPO(changed)
    assert {f: getattr(from_config, f) for f in FIELDS} == {f: getattr(changed, f) for f in FIELDS}
    from_fields = FlowGRPO(**{f: getattr(changed, f) for f in FIELDS})
    assert {f: getattr(from_fields, f) for f in FIELDS} == {f: getattr(changed, f) for f in FIELDS}
