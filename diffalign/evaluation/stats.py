"""Statistics of an evaluation: bootstrap confidence intervals over prompts, and paired win rates.

Images of the same prompt (one per seed) are correlated, so both statistics resample **prompts**, not images: a
bootstrap replicate draws as many prompts as there are, with replacement, and takes every image of each drawn prompt
(a cluster bootstrap). The interval is the percentile interval of the replicate means.
"""

from __future__ import annotations

import numpy as np


def bootstrap_ci(
    values, groups, *, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values`, resampling whole `groups` (prompts).

    Args:
        values: `(N,)` per-image values (scores, 0/1 correctness, 1/0.5/0 wins).
        groups: `(N,)` group id of each value (e.g. the prompt index); all values of a drawn group enter together.
        num_resamples: bootstrap replicates B ≥ 1.
        confidence: interval mass in (0, 1); 0.95 gives the 2.5th and 97.5th percentiles of the replicate means.
        seed: seed of the `numpy.random.default_rng` that draws the replicates (same seed and data, same interval).

    Returns:
        `(low, high)` floats. With a single group (or identical values) the interval is the mean itself.

    Raises:
        ValueError: for empty input, mismatched lengths, `num_resamples < 1` or `confidence` outside (0, 1).
    """
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    if values.ndim != 1 or values.size == 0 or groups.shape != values.shape:
        raise ValueError(f"bootstrap_ci needs equal-length non-empty 1-D values and groups, got {values.shape} and "
                         f"{groups.shape}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    _, inverse = np.unique(groups, return_inverse=True)
    sums = np.bincount(inverse, weights=values)
    counts = np.bincount(inverse).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(sums), size=(num_resamples, len(sums)))
    means = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return float(low), float(high)


def paired_wins(candidate, baseline) -> np.ndarray:
    """Per-pair outcome of `candidate` against `baseline` (same prompt and seed): 1 for a higher score (a win),
    0.5 for an equal score (a tie), 0 for a lower score (a loss). The win rate is the mean of the outcomes, so two
    identical checkpoints have a win rate of exactly 0.5.

    Args:
        candidate, baseline: `(N,)` scores of the same N (prompt, seed) pairs.

    Returns:
        `(N,)` float64 outcomes in {0, 0.5, 1}.

    Raises:
        ValueError: for mismatched lengths.
    """
    candidate = np.asarray(candidate, dtype=np.float64)
    baseline = np.asarray(baseline, dtype=np.float64)
    if candidate.shape != baseline.shape:
        raise ValueError(f"paired_wins needs scores of the same pairs, got shapes {candidate.shape} and "
                         f"{baseline.shape}")
    return np.where(candidate > baseline, 1.0, np.where(candidate == baseline, 0.5, 0.0))
