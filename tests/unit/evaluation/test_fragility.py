"""The fragility gate (diffalign.evaluation.fragility): sigma calibration against drifts known in closed form, and the
gate end to end on a tiny random model (calibrated drift within tolerance, LoRA zeroed afterwards)."""

import math

import pytest

from diffalign.evaluation.fragility import calibrate_sigma, fragility_gate, lora_b_parameters
from diffalign.evaluation.generation import EvalConfig
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.world.prompts import load_prompts


@pytest.mark.parametrize("power", [1.0, 2.0, 0.7])
def test_calibration_reaches_the_target_of_a_power_law_drift(power):
    # drift(s) = 3 s^p: the target 0.03 is reached at s* = (0.01)^(1/p); a proportional step alone lands exactly
    # for p = 1 (one rescaling), the log-log step within a few for bent curves
    cal = calibrate_sigma(lambda s: 3 * s ** power, 0.03, sigma_start=0.5, tolerance=0.01)
    assert cal.converged and abs(cal.drift - 0.03) <= 0.0003
    assert cal.sigma == pytest.approx(0.01 ** (1 / power), rel=0.02)
    assert cal.iterations <= (2 if power == 1.0 else 6)


def test_calibration_reports_no_convergence_and_its_closest_try():
    cal = calibrate_sigma(lambda s: 0.05, 0.03, sigma_start=0.1, max_iterations=3)  # drift ignores sigma
    assert not cal.converged and cal.drift == 0.05 and cal.iterations == 3
    for bad, match in [({"target": 0}, "target drift"), ({"tolerance": 1.5}, "tolerance"),
                       ({"sigma_start": -1}, "sigma_start")]:
        kw = {"target": 0.03, "sigma_start": 0.1, **bad}
        with pytest.raises(ValueError, match=match):
            calibrate_sigma(lambda s: s, **kw)


def test_gate_on_a_tiny_random_model_hits_the_drift_and_restores_the_base():
    policy = build_tiny_random_policy(seed=0)
    rows = load_prompts("heldout")[::20]  # 6 prompts
    cfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": 2, "guidance_scale": 1.0}, batch_size=16)
    report = fragility_gate(policy, rows, [0], cfg, drifts=(0.02,), directions=2, tolerance=0.1)
    (level,) = report.levels
    for d in level.directions:
        assert d.calibration.converged and abs(d.calibration.drift - 0.02) <= 0.002
        # calibrated on every image (the default): the evaluation's images are the last calibration's
        assert d.drift == d.calibration.drift
        assert d.lost + d.gained <= report.n_images and d.change == (d.gained - d.lost) / report.n_images
    assert level.directions[0].sigma != level.directions[1].sigma  # two directions, each calibrated
    assert report.n_images == 6 and report.edges.n_images == 6
    assert all(not p.any() for p in lora_b_parameters(policy))
    assert not math.isnan(report.accuracy_se) and report.passes is None  # drift 0.03 not measured
    # calibrated on a subset: the evaluation runs apart, its drift is measured on every image
    sub = fragility_gate(policy, rows, [0], cfg, drifts=(0.02,), directions=2, calibration_images=3)
    assert [d.calibration.converged for d in sub.levels[0].directions] == [True, True]
    assert sub.accuracy == report.accuracy and all(not p.any() for p in lora_b_parameters(policy))
    with pytest.raises(ValueError, match="directions must be >= 2"):
        fragility_gate(policy, rows, [0], cfg, directions=1)
    with pytest.raises(ValueError, match="shapes-world prompts"):
        fragility_gate(policy, [{"prompt": "a photo of a cat"}], [0], cfg)
