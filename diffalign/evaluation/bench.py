"""``diffalign-bench``: the miniature learning benchmark — does each method learn in the tiny world, and by how much?

For every (method, reward, seed) it runs one ``diffalign-train`` job into ``<out>/runs/<method>-<reward>-s<seed>-<hash>``
(the hash is of the run's composed config, `run_digest`, so other settings get another folder, an edited recipe file
included; a finished run is not run again, one cut short continues with ``resume=latest``), then reads back:

- the training reward per epoch (online methods, ``history.jsonl``): its rise, mean of the last 3 epochs − mean of the
  first 2;
- the run's own evaluation, base vs fine-tuned on held-out prompts with fixed seeds: the benchmark reward's mean
  (start → end and the paired gain), the verifier's held-out accuracy (``geneval_shapes``, a hacking monitor for the
  easy reward), and sample diversity (mean pairwise distance of the tiny CLIP's embeddings of one prompt's images
  across seeds, `diffalign.evaluation.monitors.pairwise_diversity`): a rise bought by collapse shows as a diversity
  drop;
- wall seconds and rollouts.

Over the seeds, each figure is a mean ± its standard error (std over seeds / √n). Every seed scores the same held-out
images, so the s.e. over seeds leaves out which images were drawn: the gain also gets the s.e. over images of the
seed-averaged per-image gain (paired, base vs fine-tuned), and the gain is given in units of the s.e. of a grand
mean over seeds crossed with images (`crossed_se`). Under a random seed effect, a random image effect and a
residual, that variance is σ²_seed/S + σ²_image/I + σ²_res/(SI); the two squared s.e. estimate σ²_seed/S +
σ²_res/(SI) and σ²_image/I + σ²_res/(SI), so their sum would count the residual twice; `crossed_se` estimates each
component once, from the S × I table of per-image gains (one seed: the paired s.e. over its images alone). The
table goes to ``<out>/bench.md``, every number to ``<out>/bench.json``, the reward curves to ``<out>/curves.png``, and
each run's sample grids stay in its ``eval/`` folder (linked from the table).

    diffalign-bench --quick                              # 4 runs: one method per data flow, a few epochs/steps,
                                                         # brightness, seed 0, a small evaluation (a smoke test)
    diffalign-bench --methods ddpo dgpo --rewards brightness --seeds 0 1 2
    diffalign-bench --list                               # the methods, rewards and their overrides

Rewards: ``brightness`` (the toy reward with large headroom, `diffalign.rewards.brightness`; offline methods get
on-policy pairs ranked by it, ``data=ranked_pairs``), ``verifier`` (``geneval_shapes`` on the train prompts), and, on
request, ``control`` (`diffalign.rewards.random_control`, random scores with no signal: the same runs show what the
updates alone do to the held-out verifier and diversity, to hold a brightness row's monitors against).
DDSPO uses no reward (its pairs come from degraded prompts), so it is benchmarked on the verifier only. The verifier
rows of ``dgpo``, ``flow_grpo``, ``dgpo_flux`` and ``flow_grpo_flux`` run their GenEval-style recipes
(``tiny_dgpo_geneval``, ``tiny_flow_grpo_geneval``: the stronger base ``tiny_sd3_wide``, 24 prompts per epoch, a
stronger KL; ``tiny_dgpo_flux_geneval``, ``tiny_flow_grpo_flux_geneval``: the same settings on the stronger FLUX base
``tiny_flux_wide``) with those recipes' own evaluation, the whole held-out split × 32 seeds (`Method.recipes`); the
table gives each row's number of paired images.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffalign.runtime.console import quiet_on_broken_pipe


@dataclass
class Method:
    """One benchmarked configuration: a recipe plus overrides; `online` says which loop (and figures) apply."""

    recipe: str
    online: bool
    overrides: list[str] = field(default_factory=list)
    quick: list[str] = field(default_factory=list)  # what --quick adds
    rewards: tuple[str, ...] = ("brightness", "verifier", "control")
    # a reward's own recipe, which replaces `recipe` and keeps its own held-out evaluation (EVAL's prompts and seeds
    # do not apply): the GenEval-style recipes on the verifier, evaluated on the whole split with 32 seeds
    recipes: dict[str, str] = field(default_factory=dict)


ONLINE_QUICK = ["online.num_epochs=3", "online.groups_per_epoch=4", "online.checkpointing_epochs=null"]
OFFLINE_QUICK = ["trainer.max_steps=10", "trainer.checkpointing_steps=null"]
# the sampler of the benchmark's data and evaluation, which the main job's recipe (tiny_dpo) lowers to 10 steps
TWENTY_SAMPLING_STEPS = ["data.sampler.num_inference_steps=20", "eval.sampler.num_inference_steps=20",
                         "eval.batch_size=64"]

METHODS: dict[str, Method] = {
    "ddpo": Method("tiny_ddpo", True, quick=ONLINE_QUICK),
    "flow_grpo": Method("tiny_flow_grpo", True, quick=ONLINE_QUICK, recipes={"verifier": "tiny_flow_grpo_geneval"}),
    # the Flow-GRPO recipe with another rollout sampler (docs/guides/samplers.md), all else equal: CPS (noise_level
    # 0.8, its released default) and MixGRPO's windowed SDE at the recipe's 10 steps (a 4-step window starting at
    # steps 0-7, moved by 1 every 2 epochs: the 20 epochs visit every start, 0 and 1 twice; MixGRPO: 25 steps, moved
    # every 25 iterations)
    "flow_grpo_cps": Method("tiny_flow_grpo", True, ["sampler=cps_sde"], quick=ONLINE_QUICK),
    "flow_grpo_window": Method("tiny_flow_grpo", True, ["sampler=window_sde", "sampler.num_inference_steps=10",
                                                        "sampler.shift_interval=2"], quick=ONLINE_QUICK),
    "grpo_guard": Method("tiny_grpo_guard", True, quick=ONLINE_QUICK),  # tiny_flow_grpo with the guard alone
    # the tiny FLUX-format model; on the verifier, the stronger FLUX base with the SD3 GenEval recipe's settings
    "flow_grpo_flux": Method("tiny_flow_grpo_flux", True, quick=ONLINE_QUICK,
                             recipes={"verifier": "tiny_flow_grpo_flux_geneval"}),
    "dgpo": Method("tiny_dgpo", True, quick=ONLINE_QUICK, recipes={"verifier": "tiny_dgpo_geneval"}),
    # DGPO on the tiny FLUX-format model; on the verifier, the stronger FLUX base with the SD3 GenEval recipe's settings
    "dgpo_flux": Method("tiny_dgpo_flux", True, quick=ONLINE_QUICK, recipes={"verifier": "tiny_dgpo_flux_geneval"}),
    "diffusion_nft": Method("tiny_diffusion_nft", True, quick=ONLINE_QUICK),
    # the SD model's verifier is more fragile: the recipe's lr 1e-3 cost 0.32 of its accuracy on brightness, 3e-4 0.08
    "dgpo_sd": Method("tiny_dgpo", True, ["model=tiny_sd", "trainer.optimizer.lr=3e-4", "online.num_epochs=20"],
                      quick=ONLINE_QUICK),
    "vipo": Method("tiny_vipo_image", True, quick=ONLINE_QUICK),
    "vipo_sd": Method("tiny_vipo_image", True, ["model=tiny_sd", "sampler=ddim", "sampler.eta=1.0"],
                      quick=ONLINE_QUICK),
    # the offline rows keep the 200 steps and the 20 sampling steps (data and evaluation) they were measured with; the
    # main job's recipe now takes 100 steps and samples with 10
    "diffusion_dpo": Method("tiny_dpo", False, ["trainer.max_steps=200", *TWENTY_SAMPLING_STEPS],
                            quick=OFFLINE_QUICK + ["data.num_prompts=32"]),
    "seppo": Method("tiny_seppo", False, quick=OFFLINE_QUICK),
    "ddspo": Method("tiny_ddspo", False, quick=OFFLINE_QUICK + ["data.max_pairs=64"], rewards=("verifier",)),
    "sft": Method("tiny_dpo", False, ["method=sft", "trainer.max_steps=200", *TWENTY_SAMPLING_STEPS],
                  quick=OFFLINE_QUICK + ["data.num_prompts=32"]),
}

REWARDS = {
    # the training reward, the evaluation rewards (the benchmark reward first), and the offline methods' data
    "brightness": {"train": ["reward=[brightness]"], "eval": "[brightness,geneval_shapes]",
                   "offline_data": ["data=ranked_pairs", "data.reward=brightness", "data.num_prompts=64"]},
    "verifier": {"train": ["reward=[geneval_shapes]"], "eval": "[geneval_shapes]", "offline_data": []},
    # the no-signal control (`random_control`): the same run with random scores; its verifier change is what the
    # updates alone do to the base, to hold a brightness row's verifier change against
    "control": {"train": ["reward=[random_control]"], "eval": "[brightness,geneval_shapes]",
                "offline_data": ["data=ranked_pairs", "data.reward=random_control", "data.num_prompts=64"]},
}
REWARD_KEY = {"brightness": "brightness/mean", "verifier": "geneval_shapes/accuracy",  # base/fine-tuned summary key
              "control": "brightness/mean"}
IMAGE_KEY = {"brightness": "brightness", "verifier": "geneval_shapes/correct",  # its per-image field in samples.jsonl
             "control": "brightness"}

# held-out evaluation of every run: up to 8 prompts per tag (33; some tags have fewer), 2 seeds
EVAL = ["eval.prompts_per_tag=8", "eval.seeds=[0,1]", "eval.reuse_base=true", "trainer.log_with=none"]
# ... of a row with its reward's own recipe (`Method.recipes`): that recipe's prompts and seeds
RECIPE_EVAL = ["eval.reuse_base=true", "trainer.log_with=none"]

# --quick: one row per data flow (the families of the loops: online trajectories, online groups, pairs, winners), on
# the brightness reward alone (the toy reward with the most headroom, so a few updates show a rise; the held-out
# verifier stays in each row as the hacking monitor), with a smaller held-out evaluation (2 prompts per tag, 12; 2
# seeds; 10 sampler steps). What it still shows: every loop and data flow runs end to end, and which way each family
# moves the reward, the verifier and the diversity; a smoke test, not a result (its gains are within noise).
QUICK_METHODS = {"online_trajectories": "flow_grpo", "online_groups": "dgpo", "pairs": "diffusion_dpo",
                 "winners": "seppo"}
QUICK_REWARDS = ["brightness"]
QUICK_EVAL = ["eval.prompts_per_tag=2", "eval.seeds=[0,1]", "eval.sampler.num_inference_steps=10",
              "eval.reuse_base=true", "trainer.log_with=none"]


TRAIN = "import sys; sys.argv = ['diffalign-train'] + sys.argv[1:]; from diffalign.cli import train; train()"


def run_digest(run_args: list[str]) -> str:
    """The 8 hex digits in a benchmark run's folder name: a SHA-256 of the ``train`` config that `run_args` compose
    from the shipped config files (unresolved, less ``output_dir`` and ``resume``, which do not change what is
    trained). An edited recipe, model or method file therefore gets a new folder instead of reusing a finished run of
    the old settings, and overrides that compose the same config (``online.num_epochs=24`` where the recipe already
    says 24) share one. Asset weights are named, not read: a changed asset under the same name is not seen.

    Raises:
        hydra.errors.HydraException / omegaconf.errors.OmegaConfBaseException: when `run_args` do not compose
            (`main` turns this into one line before any run starts).
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from diffalign.config.compose import CONFIG_DIR, setup_hydra

    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=list(run_args))
    settings = OmegaConf.to_container(cfg, resolve=False)
    for key in ("output_dir", "resume"):
        settings.pop(key, None)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]


def run_overrides(method: Method, reward: str, seed: int, quick: bool) -> list[str]:
    """The ``diffalign-train`` overrides of one benchmark run."""
    spec = REWARDS[reward]
    data = [] if method.online else spec["offline_data"]  # offline: pairs ranked by the reward (verifier: as shipped)
    evaluation, recipe = EVAL, method.recipe
    if reward in method.recipes:  # the reward's own recipe, with its own held-out evaluation
        evaluation, recipe = RECIPE_EVAL, method.recipes[reward]
    if quick:  # the method's own 20-step evaluation (offline rows) gives way to the quick one
        kept = [o for o in method.overrides if not o.startswith("eval.")]
        evaluation, method = QUICK_EVAL, Method(method.recipe, method.online, kept, method.quick, method.rewards)
    out = [f"recipe={recipe}", *method.overrides, *spec["train"], f"eval_reward={spec['eval']}",
           *data, *evaluation, f"seed={seed}"]
    if not method.online:  # every offline data set (ranked, failure, DDSPO pairs, winners) takes the seed too
        out.append(f"data.seed={seed}")
    return out + (method.quick if quick else [])


def _mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], math.nan
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def diversity(eval_dir: Path, variant: str, embedder) -> float:
    """Mean over prompts of the pairwise embedding distance of that prompt's images across seeds."""
    import numpy as np
    import torch
    from PIL import Image

    from diffalign.evaluation.monitors import pairwise_diversity

    by_prompt: dict[int, list[str]] = {}
    for line in (eval_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["variant"] == variant:
            by_prompt.setdefault(row["prompt_index"], []).append(row["image"])
    values = []
    for paths in by_prompt.values():
        if len(paths) < 2:
            continue
        images = torch.stack([torch.from_numpy(np.array(Image.open(eval_dir / p).convert("RGB"))).permute(2, 0, 1)
                              for p in paths]).float() / 255
        values.append(float(pairwise_diversity(embedder.embed_images(images))))
    return statistics.fmean(values) if values else math.nan


def image_gains(eval_dir: Path, field: str) -> dict[str, float]:
    """Per held-out image (``p<prompt_index>_s<seed>``), the fine-tuned score minus the base score of ``field`` (a
    per-image column of ``samples.jsonl``; booleans count as 0/1). Images without both variants are left out."""
    scores: dict[str, dict[str, float]] = {}
    samples = eval_dir / "samples.jsonl"
    if not samples.is_file():
        return {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        if field in row and row["variant"] in ("base", "finetuned"):
            scores.setdefault(f"p{row['prompt_index']}_s{row['seed']}", {})[row["variant"]] = float(row[field])
    return {k: v["finetuned"] - v["base"] for k, v in scores.items() if len(v) == 2}


def read_run(run_dir: Path, reward: str, embedder) -> dict:
    """The figures of one finished run (see the module docstring)."""
    res = json.loads((run_dir / "results.json").read_text())
    ev = res["eval"]
    key = REWARD_KEY[reward]
    base, ft = ev["variants"]["base"], ev["variants"]["finetuned"]
    gain = ev["finetuned_vs_base"].get(f"{key}_gain", {})
    verifier = ev["finetuned_vs_base"].get("geneval_shapes/accuracy_gain", {})  # paired over the held-out images
    out = {"seconds": res["total_seconds"], "train_seconds": res["train_seconds"],
           "start": base[key], "end": ft[key], "gain": gain.get("gain", ft[key] - base[key]), "gain_se": gain.get("se"),
           "verifier_start": base.get("geneval_shapes/accuracy"), "verifier_end": ft.get("geneval_shapes/accuracy"),
           "verifier_change": verifier.get("gain"), "verifier_change_se": verifier.get("se"),
           "diversity_start": diversity(run_dir / "eval", "base", embedder),
           "diversity_end": diversity(run_dir / "eval", "finetuned", embedder), "rollouts": res.get("rollouts"),
           "image_gains": image_gains(run_dir / "eval", IMAGE_KEY[reward]),
           "verifier_image_gains": image_gains(run_dir / "eval", IMAGE_KEY["verifier"])}
    history = run_dir / "history.jsonl"
    if history.is_file():
        curve = [json.loads(line).get("reward/mean") for line in history.read_text().splitlines()]
        curve = [c for c in curve if c is not None]
        out["train_curve"] = curve
        if len(curve) >= 5:
            out["train_rise"] = statistics.fmean(curve[-3:]) - statistics.fmean(curve[:2])
    return out


def summarize(results: dict) -> list[dict]:
    """One row per (method, reward): means ± s.e. over seeds; ``gain_se_images``, the s.e. over images of the
    seed-averaged per-image gain (the images every seed scored); ``gain_over_se``, the gain over the two s.e. combined
    (the module docstring)."""
    rows = []
    for (method, reward), runs in results.items():
        if not runs:
            continue
        row = {"method": method, "reward": reward, "seeds": len(runs),
               "images": len(runs[0].get("image_gains") or {})}  # held-out images each run scored, paired
        for name in ("start", "end", "gain", "train_rise", "verifier_start", "verifier_end", "verifier_change",
                     "diversity_start", "diversity_end", "seconds", "rollouts"):
            values = [r[name] for r in runs if r.get(name) is not None and not math.isnan(r[name])]
            row[name], row[f"{name}_se"] = _mean_se(values)
        if len(runs) == 1:  # one seed: the paired s.e. over its images instead
            row["gain_se"] = runs[0].get("gain_se") or row["gain_se"]
            row["verifier_change_se"] = runs[0].get("verifier_change_se") or row["verifier_change_se"]
        image_gains = [r.get("image_gains") or {} for r in runs]
        row["gain_se_images"] = _image_se(image_gains) if len(runs) > 1 else math.nan
        combined = crossed_se(image_gains) if len(runs) > 1 else math.nan
        if math.isnan(combined):  # one seed, or runs scored on different images: the s.e. over seeds (or images) alone
            combined = row["gain_se"]
        row["gain_se_combined"] = combined
        row["gain_over_se"] = row["gain"] / combined if combined and combined > 0 else math.nan
        row["verifier_change_se_images"] = (_image_se([r.get("verifier_image_gains") or {} for r in runs])
                                            if len(runs) > 1 else math.nan)
        rows.append(row)
    return rows


def crossed_se(gains: list[dict[str, float]]) -> float:
    """The s.e. of the grand mean gain of S runs (seeds) that scored the same I ≥ 2 images, under a two-way crossed
    random-effects model g_si = μ + a_s + b_i + e_si (seed, image, residual; one observation per cell).

    From the ANOVA mean squares of the S × I table, MS_seed = I Σ_s (ḡ_s − ḡ)² / (S − 1), MS_image = S Σ_i (ḡ_i − ḡ)² /
    (I − 1) and MS_res = Σ_si (g_si − ḡ_s − ḡ_i + ḡ)² / ((S − 1)(I − 1)), whose expectations are σ²_res + I σ²_seed,
    σ²_res + S σ²_image and σ²_res (the ANOVA estimation of balanced data; Searle, Casella & McCulloch 1992,
    *Variance Components*), the components σ̂²_seed = max(0, (MS_seed − MS_res) / I) and σ̂²_image = max(0, (MS_image −
    MS_res) / S) (truncated at 0, the usual ANOVA estimator's fix) give Var(ḡ) = σ̂²_seed / S + σ̂²_image / I + MS_res / (SI). Untruncated this is
    (MS_seed + MS_image − MS_res) / (SI): the sum of the squared s.e. over seeds and over images (each MS / (SI)) minus
    the residual's share, which that sum counts twice.

    Args:
        gains: one ``{image: gain}`` per run (`image_gains`).

    Returns:
        The s.e. (units of the gain), or NaN unless S ≥ 2 runs all scored the same I ≥ 2 images.
    """
    keys = sorted(gains[0]) if gains else []
    if len(gains) < 2 or len(keys) < 2 or any(set(g) != set(keys) for g in gains):
        return math.nan
    table = [[g[k] for k in keys] for g in gains]
    n_s, n_i = len(table), len(keys)
    mean = statistics.fmean(v for row in table for v in row)
    seed_means = [statistics.fmean(row) for row in table]
    image_means = [statistics.fmean(row[i] for row in table) for i in range(n_i)]
    ms_seed = n_i * sum((m - mean) ** 2 for m in seed_means) / (n_s - 1)
    ms_image = n_s * sum((m - mean) ** 2 for m in image_means) / (n_i - 1)
    ms_res = sum((table[s][i] - seed_means[s] - image_means[i] + mean) ** 2
                 for s in range(n_s) for i in range(n_i)) / ((n_s - 1) * (n_i - 1))
    var_seed, var_image = max(0.0, (ms_seed - ms_res) / n_i), max(0.0, (ms_image - ms_res) / n_s)
    return math.sqrt(var_seed / n_s + var_image / n_i + ms_res / (n_s * n_i))


def _image_se(gains: list[dict[str, float]]) -> float:
    """S.e. over images of the per-image gain averaged over runs; NaN unless every run scored the same ≥ 2 images."""
    keys = set(gains[0])
    if len(keys) < 2 or any(set(g) != keys for g in gains):
        return math.nan
    averaged = [statistics.fmean(g[k] for g in gains) for k in sorted(keys)]
    return statistics.stdev(averaged) / math.sqrt(len(averaged))


def _fmt(value, se=None, digits=3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = f"{value:.{digits}f}"
    if se is not None and not (isinstance(se, float) and math.isnan(se)):
        text += f" ± {se:.{digits}f}"
    return text


def _images(row: dict, key: str = "gain_se_images") -> str:
    se = row.get(key, math.nan)
    return "" if se is None or math.isnan(se) else f", ± {se:.3f} images"


def markdown(rows: list[dict], command: str) -> str:
    lines = [(f"Generated by `{command}`. Mean ± s.e. over seeds; start/end = base/fine-tuned on held-out prompts "
             "(images = the paired base/fine-tuned images of one run: up to 8 prompts per tag, 33 prompts × 2 seeds, "
             "or a row recipe's own evaluation); gain ± s.e. over seeds, then the s.e. over images of the seed-averaged "
             "per-image gain; gain/s.e. = the gain over the s.e. of a mean over seeds crossed with images (each variance "
             "component counted once: `diffalign.evaluation.bench.crossed_se`; one seed: the paired s.e. over its "
             "images); the verifier change ± s.e. over seeds, then over images; train rise = mean training reward of the last 3 epochs − first 2 (online methods); held-out verifier "
             "acc. = geneval_shapes accuracy base → fine-tuned and its change ± s.e. (a hacking monitor on the brightness "
             "rows); diversity = the tiny CLIP's mean pairwise distance across seeds, base → fine-tuned."), "",
             ("| method | reward | seeds | images | start → end | gain (gain/s.e.) | train rise | held-out verifier acc. | "
             "verifier change | diversity | s per run |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['reward']} | {r['seeds']} | {r.get('images') or '–'} | {_fmt(r['start'])} → {_fmt(r['end'])} | "
            f"{_fmt(r['gain'], r['gain_se'])}{_images(r)} ({_fmt(r['gain_over_se'], digits=1)}) | "
            f"{_fmt(r['train_rise'], r['train_rise_se'])} | {_fmt(r['verifier_start'])} → {_fmt(r['verifier_end'])} | "
            f"{_fmt(r['verifier_change'], r['verifier_change_se'])}{_images(r, 'verifier_change_se_images')} | "
            f"{_fmt(r['diversity_start'])} → {_fmt(r['diversity_end'])} | {_fmt(r['seconds'], digits=0)} |")
    return "\n".join(lines) + "\n"


def plot_curves(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {key: [r["train_curve"] for r in runs if r.get("train_curve")] for key, runs in results.items()}
    curves = {key: c for key, c in curves.items() if c}
    if not curves:
        return
    rewards = sorted({reward for _, reward in curves})
    fig, axes = plt.subplots(1, len(rewards), figsize=(6 * len(rewards), 4), squeeze=False)
    for ax, reward in zip(axes[0], rewards):
        for (method, rw), runs in curves.items():
            if rw != reward:
                continue
            n = min(len(c) for c in runs)
            mean = [statistics.fmean(c[i] for c in runs) for i in range(n)]
            ax.plot(range(1, n + 1), mean, label=method)
        ax.set_title(f"training reward: {reward}")
        ax.set_xlabel("epoch")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diffalign-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                   help=f"default: all (with --quick: one per data flow, {', '.join(QUICK_METHODS.values())})")
    p.add_argument("--rewards", nargs="+", default=None, choices=list(REWARDS),
                   help="brightness | verifier | control (random scores: what the updates alone do; default: the first "
                        "two; with --quick: brightness)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (0 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"{len(QUICK_METHODS)} runs (one method per data flow, brightness, seed 0), a few epochs/steps "
                        "each and a 12-prompt evaluation at 10 steps: a smoke test, not a result")
    p.add_argument("--out", default="runs/bench", help="output folder (runs, table, plots); reruns resume in it")
    p.add_argument("--list", action="store_true", help="print the runs' overrides and exit")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    argv = list(sys.argv[1:] if argv is None else argv)
    # Hydra overrides (key=value) may follow any option, e.g. `--seeds 0 1 2 trainer.optimizer.lr=5e-3`
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = p.parse_args([a for a in argv if a not in overrides])
    args.overrides = [*args.overrides, *overrides]
    seeds = list(dict.fromkeys(args.seeds)) if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    if args.methods is None:
        args.methods = list(QUICK_METHODS.values()) if args.quick else list(METHODS)
    if args.rewards is None:
        args.rewards = list(QUICK_REWARDS) if args.quick else ["brightness", "verifier"]
    jobs = [(m, r, s) for m in args.methods for r in args.rewards if r in METHODS[m].rewards for s in seeds]
    if not jobs:
        p.error(f"no runs: none of --methods {args.methods} is benchmarked on --rewards {args.rewards} "
                "(DDSPO has a verifier row only); see --list")
    if args.list:
        for m, r, s in jobs:
            print(f"{m}-{r}-s{s}: diffalign-train " + " ".join(run_overrides(METHODS[m], r, s, args.quick)
                                                               + args.overrides))
        return 0
    from tqdm.auto import tqdm

    from diffalign.rewards.clip_score import ClipScore

    out = Path(args.out)
    try:
        (out / "runs").mkdir(parents=True, exist_ok=True)
        (out / "runs" / ".write-test").touch()
        (out / "runs" / ".write-test").unlink()
    except OSError as err:
        p.error(f"--out {args.out}: cannot write there ({err.strerror}); pass a writable folder")
    # every run's settings composed before any run starts: a bad override is one line, not a failure per run; the
    # folder name carries a hash of the composed settings, so other settings never reuse a finished run
    planned = []
    for m, r, s in jobs:
        run_args = [*run_overrides(METHODS[m], r, s, args.quick), *args.overrides]
        try:
            planned.append((m, r, s, run_args, run_digest(run_args)))
        except Exception as err:  # noqa: BLE001 - Hydra's and OmegaConf's composition errors, named in one line
            from diffalign.config.composition import describe_composition_error

            line = describe_composition_error(err, run_args) or str(err).splitlines()[0]
            p.error(f"the {m}-{r}-s{s} run does not compose: {line}")
    embedder = ClipScore()
    results: dict[tuple[str, str], list[dict]] = {}
    failures = []
    for m, r, s, run_args, digest in tqdm(planned, desc="bench", unit="run"):
        run_dir = out / "runs" / f"{m}-{r}-s{s}-{digest}"
        if not (run_dir / "results.json").is_file():
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "bench_overrides.json").write_text(json.dumps(run_args, indent=2))
            cmd = [sys.executable, "-c", TRAIN, f"output_dir={run_dir}", *run_args]
            if any(run_dir.glob("checkpoint-*")):
                cmd.append("resume=latest")
            t0 = time.time()
            log = run_dir.parent / f"{run_dir.name}.log"
            with log.open("a") as f:
                done = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                failures.append(f"{m}-{r}-s{s} (exit {done.returncode}, log {log})")
                tqdm.write(f"[bench] {m}-{r}-s{s} failed after {time.time() - t0:.0f}s; see {log}")
                continue
        figures = read_run(run_dir, r, embedder)
        results.setdefault((m, r), []).append(figures)
        tqdm.write(f"[bench] {m}-{r}-s{s}: {REWARD_KEY[r]} {figures['start']:.3f} -> {figures['end']:.3f}, "
                   f"{figures['seconds']:.0f}s")
    rows = summarize(results)
    command = "diffalign-bench " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "bench.md").write_text(markdown(rows, command))
    (out / "bench.json").write_text(json.dumps({"command": command, "rows": rows,
                                                "runs": {f"{m}/{r}": v for (m, r), v in results.items()}}, indent=2))
    plot_curves(results, out / "curves.png")
    print(markdown(rows, command))
    print(f"[bench] table {out / 'bench.md'}, numbers {out / 'bench.json'}, curves {out / 'curves.png'}")
    if failures:
        print("[bench] failed runs: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
