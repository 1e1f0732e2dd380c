"""The rollout-vs-recompute log-prob gap under classifier-free guidance (scripts/logprob_gap.py), per model family.

The project's contract (docs/guides/reliability.md#trainrollout-consistency, docs/guides/online.md#log-prob-gap-under-cfg):
before the first update the ratio π_θ/π_old of every stored transition is 1 within 1e-5 in float32. Checked here
with CFG on (w = 7; FLUX embeds w instead of a CFG batch) for every family's tiny model, recomputing both the
rollout's batch as sampled and each row alone (a training minibatch that batches the rows otherwise). The last test
shows the measurement can fail: a bf16-autocast recompute of an fp32 rollout is far outside the tolerance."""

from __future__ import annotations

import pytest
from conftest import load_script

RATIO_TOLERANCE = 1e-5

logprob_gap = load_script("logprob_gap")


@pytest.fixture(scope="module")
def policies():
    return {}


def _policy(policies, family):
    if family not in policies:
        policies[family] = logprob_gap.build_policy(family)
    return policies[family]


@pytest.mark.parametrize("family", logprob_gap.FAMILIES)
def test_the_fp32_ratio_is_one_within_the_contract_with_cfg_on(family, policies):
    gap = logprob_gap.measure(_policy(policies, family), family, 7.0, "fp32", num_inference_steps=3)
    assert gap.max_ratio_dev <= RATIO_TOLERANCE, gap
    assert gap.rebatched_max_abs <= RATIO_TOLERANCE, gap  # |Δ log π| ≤ 1e-5 ⇒ |ρ − 1| ≤ 1.00001e-5
    assert len(gap.per_step) == 3


def test_the_measurement_sees_a_precision_mismatch(policies):
    if not logprob_gap.bf16_available():
        pytest.skip("this CPU cannot autocast to bfloat16")
    gap = logprob_gap.measure(_policy(policies, "sd3"), "sd3", 7.0, "mixed", num_inference_steps=3)
    assert gap.max_ratio_dev > 100 * RATIO_TOLERANCE, gap


def test_bad_arguments_are_refused_naming_the_flag(policies):
    with pytest.raises(ValueError, match="--precisions: unknown precision 'fp8'"):
        logprob_gap.measure(None, "sd3", 1.0, "fp8")
    with pytest.raises(ValueError, match="--families: unknown family 'sd2'"):
        logprob_gap.build_policy("sd2")
