"""The fragility gate of a base model: does a change that carries no reward already cost verifier accuracy?

Online RL moves a base model's images by a mean absolute pixel difference of about 0.014–0.031 (pixels in [0, 1];
docs/results/verifier.md). If a *random* weight change of that size already loses correct images, no reward signal
of that size can show up in held-out accuracy. The gate measures, for one base (`fragility_gate`):

1. its held-out verifier accuracy (every (prompt, seed) image, the evaluation's per-image seeds);
2. for each target image drift (default 0.02 and 0.03) and each of `directions` random directions: every LoRA ``B``
   matrix set to ``sigma * N(0, 1)`` (the direction fixed by its seed, ``1000 + d`` as in
   ``experiments/verifier_fragility_probe.py``), with ``sigma`` calibrated (on every image by default, or on a subset)
   until the image drift ``mean |image - base image|`` is within `tolerance` (relative) of the target
   (`calibrate_sigma`), then the accuracy change on every image; mean ± s.e. over the directions;
3. the fraction of the base's correct images that a one-pixel edge change of one object flips to wrong
   (`diffalign.world.edges`: grow, shrink, or shift one object by one pixel).

Target of a base meant for online RL on the verifier (issue 34): accuracy 0.35–0.65, and drift 0.03 costs at most
0.01 accuracy (`GATE_MAX_LOSS`, `GATE_ACCURACY`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from diffalign.evaluation.generation import EvalConfig, sample_images
from diffalign.world.edges import EdgeFlips, edge_flips
from diffalign.world.verifier import parse_caption, verify

GATE_ACCURACY = (0.35, 0.65)
GATE_MAX_LOSS = 0.01  # accuracy a random direction at drift GATE_DRIFT may cost
GATE_DRIFT = 0.03


@dataclass
class Calibration:
    """The outcome of `calibrate_sigma`: the chosen `sigma`, the `drift` measured at it, the `iterations` used and
    whether that drift is within the tolerance (`converged`)."""

    sigma: float
    drift: float
    iterations: int
    converged: bool


def calibrate_sigma(drift_at: Callable[[float], float], target: float, sigma_start: float, tolerance: float = 0.1,
                    max_iterations: int = 6) -> Calibration:
    """Finds a scale `sigma` whose drift ``drift_at(sigma)`` is within ``tolerance * target`` of `target`.

    The drift of a random weight direction is close to proportional to its scale for small scales, so each step
    rescales ``sigma <- sigma * target / drift`` (from the second step on, by the exponent of the last two points
    on a log-log line, clamped to [0.5, 2], for drifts that bend). When no step gets within the tolerance the
    closest one is returned with ``converged=False``.

    Args:
        drift_at: the drift (≥ 0) at a scale.
        target: the drift wanted, > 0.
        sigma_start: the first scale tried, > 0.
        tolerance: relative, in (0, 1).
        max_iterations: evaluations of `drift_at` at most, ≥ 1.

    Raises:
        ValueError: for a non-positive `target` or `sigma_start`, a `tolerance` outside (0, 1), `max_iterations` < 1.
    """
    if not target > 0:
        raise ValueError(f"target drift must be > 0, got {target}")
    if not sigma_start > 0:
        raise ValueError(f"sigma_start must be > 0, got {sigma_start}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1) (relative to the target drift), got {tolerance}")
    if max_iterations < 1:
        raise ValueError(f"max_iterations must be >= 1, got {max_iterations}")
    sigma, tried = sigma_start, []
    for it in range(1, max_iterations + 1):
        drift = float(drift_at(sigma))
        tried.append((sigma, drift))
        if abs(drift - target) <= tolerance * target:
            return Calibration(sigma, drift, it, True)
        if drift <= 0:
            sigma *= 10.0
            continue
        exponent = 1.0
        if len(tried) >= 2:
            (s0, d0), (s1, d1) = tried[-2], tried[-1]
            if d0 > 0 and s0 != s1 and d0 != d1:
                exponent = min(max(math.log(d1 / d0) / math.log(s1 / s0), 0.5), 2.0)
        sigma *= (target / drift) ** (1.0 / exponent)
    best_sigma, best_drift = min(tried, key=lambda sd: abs(sd[1] - target))
    return Calibration(best_sigma, best_drift, max_iterations, False)


def lora_b_parameters(policy) -> list[torch.nn.Parameter]:
    """The trainable LoRA ``B`` matrices of `policy.denoiser`, in `named_parameters` order.

    Raises:
        ValueError: when the denoiser has none (no LoRA adapter: set ``model.lora_rank``).
    """
    params = [p for name, p in policy.denoiser.named_parameters() if p.requires_grad and "lora_B" in name]
    if not params:
        raise ValueError("the policy's denoiser has no trainable LoRA B matrices; the gate needs a LoRA adapter "
                         "(set model.lora_rank, e.g. model.lora_rank=8)")
    return params


@torch.no_grad()
def set_direction(params: list[torch.nn.Parameter], sigma: float, seed: int) -> None:
    """Sets every matrix of `params` to ``sigma * N(0, 1)`` drawn in order from ``torch.Generator().manual_seed(seed)``
    (so one seed is one direction at every scale)."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        if sigma == 0:
            p.zero_()
            continue
        p.copy_(torch.randn(p.shape, generator=gen) * sigma)


@dataclass
class DirectionResult:
    """One random direction at one target drift: its `seed`, the calibrated `sigma`, the `calibration` drift (on the
    calibration subset) and the `drift`, accuracy `change` (fraction), images `lost` and `gained` on every image."""

    seed: int
    sigma: float
    calibration: Calibration
    drift: float
    change: float
    lost: int
    gained: int


@dataclass
class DriftLevel:
    """Every direction at one `target` drift."""

    target: float
    directions: list[DirectionResult] = field(default_factory=list)

    @property
    def mean_change(self) -> float:
        return float(np.mean([d.change for d in self.directions]))

    @property
    def se_change(self) -> float:
        """Standard error of `mean_change` over the directions (sample std / sqrt(n); nan for one direction)."""
        c = [d.change for d in self.directions]
        return float(np.std(c, ddof=1) / math.sqrt(len(c))) if len(c) > 1 else float("nan")

    @property
    def mean_drift(self) -> float:
        return float(np.mean([d.drift for d in self.directions]))


@dataclass
class GateReport:
    """The fragility gate's figures for one base (see the module docstring)."""

    n_images: int
    accuracy: float
    accuracy_se: float
    levels: list[DriftLevel]
    edges: EdgeFlips
    seconds: float = 0.0

    def level(self, target: float) -> DriftLevel | None:
        return next((lv for lv in self.levels if math.isclose(lv.target, target)), None)

    @property
    def passes(self) -> bool | None:
        """True when the accuracy is in `GATE_ACCURACY` and drift `GATE_DRIFT` costs at most `GATE_MAX_LOSS`;
        None when that drift was not measured."""
        lv = self.level(GATE_DRIFT)
        if lv is None:
            return None
        return GATE_ACCURACY[0] <= self.accuracy <= GATE_ACCURACY[1] and lv.mean_change >= -GATE_MAX_LOSS

    def lines(self) -> list[str]:
        """The report as console lines."""
        out = [f"held-out accuracy {self.accuracy:.3f} ± {self.accuracy_se:.3f} ({self.n_images} images)"]
        for lv in self.levels:
            out.append(f"drift {lv.target:.3f}: accuracy change {lv.mean_change:+.3f} ± {lv.se_change:.3f} over "
                       f"{len(lv.directions)} directions (measured drift {lv.mean_drift:.4f}; lost "
                       f"{sum(d.lost for d in lv.directions)}, gained {sum(d.gained for d in lv.directions)})")
            out += [f"    direction {d.seed}: sigma {d.sigma:.4g} (calibration drift {d.calibration.drift:.4f} in "
                    f"{d.calibration.iterations} tries{'' if d.calibration.converged else ', NOT converged'}), drift "
                    f"{d.drift:.4f}, change {d.change:+.3f}, lost {d.lost}, gained {d.gained}"
                    for d in lv.directions]
        e = self.edges
        out.append(f"one-pixel edge flips: {e.n_flipped} of {e.n_correct} correct images = {e.fraction:.3f} ± "
                   f"{e.se:.3f}; by change: " + ", ".join(f"{k} {v}" for k, v in e.by_change.items()))
        verdict = {True: "PASSES", False: "FAILS", None: "not judged (drift 0.03 not measured)"}[self.passes]
        out.append(f"gate (accuracy in {GATE_ACCURACY[0]}–{GATE_ACCURACY[1]}, drift {GATE_DRIFT} costs ≤ "
                   f"{GATE_MAX_LOSS}): {verdict}; {self.seconds:.0f} s")
        return out


def _pixels(images: torch.Tensor) -> np.ndarray:
    """`(N, 3, H, W)` in [0, 1] → uint8 `(N, H, W, 3)`, rounded as the geneval_shapes reward rounds."""
    return (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)


def _specs(rows: list[dict]) -> list[dict]:
    specs = []
    for row in rows:
        if "include" in row:
            specs.append(row)
            continue
        try:
            specs.append(parse_caption(row["prompt"]))
        except ValueError as err:
            raise ValueError(f"fragility gate prompts: {err}; the gate scores shapes-world prompts only (rows with "
                             "GenEval 'include' metadata or the world's captions)") from None
    return specs


def fragility_gate(policy, rows: list[dict], seeds: list[int], cfg: EvalConfig, drifts=(0.02, 0.03),
                   directions: int = 4, calibration_images: int = 0, tolerance: float = 0.1,
                   sigma_start: float = 0.02, log: Callable[[str], None] | None = None) -> GateReport:
    """Measures the fragility gate of `policy`'s base (module docstring).

    Args:
        policy: a policy with a LoRA adapter on its denoiser (its ``B`` matrices are overwritten, then zeroed).
        rows: shapes-world prompt rows (GenEval metadata), e.g. ``load_prompts("heldout")``.
        seeds: evaluation seeds; every (seed, prompt) image is made from its own generator
            (`diffalign.evaluation.generation.generate`).
        cfg: the evaluation settings (sampler, batch size).
        drifts: target image drifts (mean absolute pixel difference, pixels in [0, 1]), each > 0.
        directions: random directions per drift, ≥ 2 (for the s.e.).
        calibration_images: images (evenly spaced through the (seed, prompt) list) on which sigma is calibrated;
            0 (the default) or at least every image: on every image, so that the drift reported is the calibrated one
            and the last calibration's images are the evaluation's (measured on tiny_sd3: σ calibrated on 16 of 117
            images gave a drift of 0.026 on all of them for a target of 0.02).
        tolerance: relative tolerance of the calibrated drift, in (0, 1).
        sigma_start: the first scale tried for the first direction (later ones start from the last one found).
        log: called with a progress line after each step.

    Raises:
        ValueError: for a bad argument (named), prompts that are not shapes-world prompts, or a policy without LoRA.
    """
    if not drifts or any(not d > 0 for d in drifts):
        raise ValueError(f"drifts must be a non-empty list of positive image drifts (e.g. 0.02 0.03), got {drifts}")
    if directions < 2:
        raise ValueError(f"directions must be >= 2 (the s.e. is over directions), got {directions}")
    if calibration_images < 0:
        raise ValueError(f"calibration_images must be >= 0 (0: every image), got {calibration_images}")
    if not seeds:
        raise ValueError("seeds must name at least one evaluation seed")
    specs = _specs(rows)
    params = lora_b_parameters(policy)
    say = log or (lambda _line: None)
    start = time.perf_counter()
    jobs = [(p, s) for s in seeds for p in range(len(rows))]  # generate's order: seeds outer, prompts inner
    all_specs = [specs[p] for p, _ in jobs]
    every = calibration_images == 0 or calibration_images >= len(jobs)
    pick = np.arange(len(jobs)) if every else \
        np.unique(np.linspace(0, len(jobs) - 1, calibration_images).round().astype(int))
    calib_jobs = [jobs[i] for i in pick]

    def sample(job_list: list[tuple[int, int]], use_reference: bool) -> torch.Tensor:  # in generate's batches
        return torch.cat([sample_images(policy, job_list[i:i + cfg.batch_size], rows, cfg, use_reference)
                          for i in range(0, len(job_list), cfg.batch_size)])

    def correct(images: torch.Tensor) -> np.ndarray:
        return np.array([verify(im, sp).correct for im, sp in zip(_pixels(images), all_specs)])

    try:
        set_direction(params, 0.0, 0)
        base_img = sample(jobs, use_reference=True)
        base_px = _pixels(base_img)
        base_ok = correct(base_img)
        n = len(base_ok)
        acc = float(base_ok.mean())
        say(f"base: accuracy {acc:.3f} on {n} images ({time.perf_counter() - start:.0f} s)")
        calib_base = base_img[torch.as_tensor(pick)]
        made: dict[float, torch.Tensor] = {}  # calibrated on every image: the images of each sigma tried

        def drift_at(sigma: float, seed: int) -> float:
            set_direction(params, sigma, seed)
            img = sample(calib_jobs, use_reference=False)
            if every:
                made[sigma] = img
            return float((img - calib_base).abs().mean())

        levels, sigma = [], sigma_start
        for target in drifts:
            level = DriftLevel(target)
            for d in range(directions):
                seed = 1000 + d
                made.clear()
                cal = calibrate_sigma(lambda s, seed=seed: drift_at(s, seed), target, sigma, tolerance)
                sigma = cal.sigma
                if every:
                    img = made[cal.sigma]
                else:
                    set_direction(params, cal.sigma, seed)
                    img = sample(jobs, use_reference=False)
                diff = correct(img).astype(int) - base_ok.astype(int)
                level.directions.append(DirectionResult(seed, cal.sigma, cal, float((img - base_img).abs().mean()),
                                                        float(diff.mean()), int((diff < 0).sum()),
                                                        int((diff > 0).sum())))
                r = level.directions[-1]
                say(f"drift {target}: direction {seed} sigma {r.sigma:.4g} drift {r.drift:.4f} change "
                    f"{r.change:+.3f} ({time.perf_counter() - start:.0f} s)")
            levels.append(level)
    finally:
        set_direction(params, 0.0, 0)
    edges = edge_flips(base_px, all_specs)
    return GateReport(n, acc, float(math.sqrt(acc * (1 - acc) / n)), levels, edges, time.perf_counter() - start)
