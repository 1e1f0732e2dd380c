"""Scoring and statistics of an evaluation: every reward on every image, per-reward means with standard errors and
prompt-level bootstrap intervals, GenEval-style accuracy overall and per tag, paired gains and win rates of one variant
over another (definitions in ``docs/guides/evaluation.md``).
"""

from __future__ import annotations

import math

import torch

from diffalign.evaluation.stats import bootstrap_ci, paired_wins
from diffalign.rewards.reward_set import checked_rewards

TAG_ORDER = ("single_object", "colors", "counting", "two_object", "color_attr", "position")


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def score(rewards: dict, images: torch.Tensor, rows: list[dict], records: list[dict]) -> dict[str, dict]:
    """Runs every reward on the images; returns ``{reward name: {"scores": [...], "correct": [...]?}}``."""
    by_prompt = {r["prompt"]: r for r in rows}
    prompts = [rec["prompt"] for rec in records]
    return score_batch(rewards, images, prompts, [by_prompt[rec["prompt"]] for rec in records])


def score_batch(rewards: dict, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, dict]:
    """Every reward's scores (and correctness) of a batch, each call checked
    (`diffalign.rewards.reward_set.CheckedReward`; rewards given unguarded are wrapped, guarded ones keep the step they
    name in errors)."""
    out = {}
    for name, reward in checked_rewards(rewards).items():
        res = reward(images, prompts, metadata)
        entry = {"scores": res.scores.float().tolist()}
        if "correct" in res.info:
            entry["correct"] = [bool(c) for c in res.info["correct"]]
            entry["failed"] = res.info.get("failed")
        out[name] = entry
    return out


def ordered_tags(records: list[dict]) -> list[str]:
    """The tags present, GenEval's order first, then the others alphabetically."""
    present = {rec.get("tag") for rec in records if rec.get("tag")}
    return sorted(present, key=lambda t: (t not in TAG_ORDER, TAG_ORDER.index(t) if t in TAG_ORDER else 0, t))


def summarize(scored: dict[str, dict], records: list[dict], *, num_resamples: int = 1000, confidence: float = 0.95,
              seed: int = 0) -> dict:
    """Statistics of one variant, per reward ``name``:

    - ``name/mean``, ``name/se``, ``name/mean_ci`` (``[low, high]``, prompt-level bootstrap), and per tag
      ``name/mean/<tag>`` = ``{"mean", "se", "n"}``;
    - for rewards that report correctness (GenEval-style verifiers): ``name/accuracy``, ``name/accuracy_se``,
      ``name/accuracy_ci``, per tag ``name/accuracy/<tag>`` = ``{"accuracy", "se", "n", "ci"}``, and
      ``name/accuracy_tag_mean`` (the mean of the per-tag accuracies: GenEval's "overall" score).

    `records` give each image's ``tag`` and ``prompt_index`` (the bootstrap's groups; the image index when absent).
    """
    summary: dict = {"num_images": len(records)}
    groups = [rec.get("prompt_index", i) for i, rec in enumerate(records)]
    tags = ordered_tags(records)
    boot = {"num_resamples": num_resamples, "confidence": confidence, "seed": seed}
    for name, entry in scored.items():
        m, se = _mean_se(entry["scores"])
        summary[f"{name}/mean"], summary[f"{name}/se"] = m, se
        summary[f"{name}/mean_ci"] = list(bootstrap_ci(entry["scores"], groups, **boot))
        for tag in tags:
            vals = [v for v, rec in zip(entry["scores"], records) if rec.get("tag") == tag]
            a, s = _mean_se(vals)
            summary[f"{name}/mean/{tag}"] = {"mean": a, "se": s, "n": len(vals)}
        if "correct" in entry:
            correct = [float(c) for c in entry["correct"]]
            acc, acc_se = _mean_se(correct)
            summary[f"{name}/accuracy"], summary[f"{name}/accuracy_se"] = acc, acc_se
            summary[f"{name}/accuracy_ci"] = list(bootstrap_ci(correct, groups, **boot))
            for tag in tags:
                pick = [i for i, rec in enumerate(records) if rec.get("tag") == tag]
                vals = [correct[i] for i in pick]
                a, s = _mean_se(vals)
                summary[f"{name}/accuracy/{tag}"] = {"accuracy": a, "se": s, "n": len(vals),
                                                     "ci": list(bootstrap_ci(vals, [groups[i] for i in pick], **boot))}
            if tags:
                summary[f"{name}/accuracy_tag_mean"] = sum(summary[f"{name}/accuracy/{t}"]["accuracy"]
                                                           for t in tags) / len(tags)
    return summary


def compare(scored_a: dict, scored_b: dict, label_a: str, label_b: str, *, groups: list | None = None,
            num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict:
    """Variant b against variant a on the same prompts and seeds, per reward ``name``:

    - ``name/mean_gain``: the paired difference of the scores b − a with its standard error and their ratio; for a
      reward with correctness also ``name/accuracy_gain``, the same for its 0/1 correctness (first in the dict, so
      the headline and the report take it), e.g. ``geneval_shapes``: accuracy and the dense score side by side;
    - ``name/win_rate``: the mean over (prompt, seed) pairs of 1 (b's score higher), 0.5 (equal) or 0 (lower)
      (`diffalign.evaluation.stats.paired_wins`; identical variants give exactly 0.5), with counts and a prompt-level
      bootstrap interval over `groups` (the prompt index of each pair; each pair its own group when None).
    """
    out = {}
    for name, entry_a in scored_a.items():
        for key, metric in (("correct", "accuracy"), ("scores", "mean")):
            if key not in entry_a:
                continue
            diff = [float(b) - float(a) for a, b in zip(entry_a[key], scored_b[name][key])]
            m, se = _mean_se(diff)
            out[f"{name}/{metric}_gain"] = {"gain": m, "se": se, "gain_over_se": m / se if se > 0 else float("inf"),
                                            "of": f"{label_b} - {label_a}"}
        wins = paired_wins(scored_b[name]["scores"], entry_a["scores"])
        pair_groups = groups if groups is not None else list(range(len(wins)))
        out[f"{name}/win_rate"] = {
            "win_rate": float(wins.mean()), "wins": int((wins == 1).sum()), "ties": int((wins == 0.5).sum()),
            "losses": int((wins == 0).sum()), "n": len(wins), "of": f"{label_b} over {label_a}",
            "ci": list(bootstrap_ci(wins, pair_groups, num_resamples=num_resamples, confidence=confidence, seed=seed)),
        }
    return out
