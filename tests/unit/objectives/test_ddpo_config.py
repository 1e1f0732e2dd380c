"""`DDPO` is built from `DDPOConfig`, the one place its released defaults are written (ddpo-pytorch
``config/base.py``: ``train.clip_range = 1e-4``, ``train.timestep_fraction = 1.0``, no KL): every field reaches the
objective, from the defaults, from a config object and from keyword fields, and the fixed choices of DDPO_IS (per-prompt
advantages, gradients through both CFG branches, the exact Gaussian KL form) hold whatever the config says (found by
mutation testing, docs/contributing.md#mutation-testing)."""

from __future__ import annotations

from diffalign.objectives.ddpo import DDPO, DDPOConfig

FIELDS = ("clip_range", "beta_kl", "timestep_fraction", "timestep_selection", "logprob_check", "logprob_tolerance")


def test_every_config_field_reaches_the_objective():
    method = DDPO()
    assert {f: getattr(method, f) for f in FIELDS} == {"clip_range": 1e-4, "beta_kl": 0.0, "timestep_fraction": 1.0,
                                                       "timestep_selection": "random", "logprob_check": "stop",
                                                       "logprob_tolerance": 1e-3}
    assert DDPOConfig()._target_ == "diffalign.objectives.ddpo.DDPO"
    changed = DDPOConfig(clip_range=0.2, beta_kl=0.5, timestep_fraction=0.5, timestep_selection="per_sample",
                         logprob_check="warn", logprob_tolerance=0.25)
    from_config = DDPO(changed)
    assert {f: getattr(from_config, f) for f in FIELDS} == {f: getattr(changed, f) for f in FIELDS}
    from_fields = DDPO(**{f: getattr(changed, f) for f in FIELDS})
    assert {f: getattr(from_fields, f) for f in FIELDS} == {f: getattr(changed, f) for f in FIELDS}
    for built in (method, from_config, from_fields):
        assert (built.kl_form, built.detach_unconditional, built.advantage) == ("exact", False, "per_prompt")
