"""A static HTML report of an evaluation (and of the training run behind it), readable in a browser without a server.

`write_report(eval_dir, run_dir)` reads what `diffalign.evaluation.evaluate.evaluate_policy` wrote into `eval_dir`
(``metrics.json``, ``samples.jsonl``, ``grids/``, videos), draws plots with matplotlib into ``eval_dir/plots/`` —
every scalar of the run's TensorBoard logs (``<run_dir>/logs``, written by accelerate's tensorboard tracker) against
the step, and each reward against the checkpoint step when several checkpoints of a run were evaluated — and writes
``eval_dir/report.html``: the metrics table (means with bootstrap intervals, accuracy, win rates and gains over the
baseline), the per-tag table, the plots and one grid per prompt. Images are linked by relative paths, so the report
opens from the file system (``file://``) and stays valid when the whole ``eval_dir`` is copied elsewhere.
"""

from __future__ import annotations

import html
import json
import logging
import re
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from diffalign.evaluation.scoring import ordered_tags
from diffalign.runtime.storage import atomic_file, write_text

MAX_EAGER_GRIDS = 24  # grids after these load lazily, when scrolled to


def read_scalars(logs_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under `logs_dir` (searched recursively), as
    ``{tag: [(step, value), ...]}`` sorted by step; a step written twice (a resumed run) keeps its last value.
    Returns ``{}`` when there are no event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # (it logs each file read at INFO)
    series: dict[str, dict[int, float]] = {}
    for folder in sorted({p.parent for p in Path(logs_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for event in acc.Scalars(tag):
                series.setdefault(tag, {})[event.step] = event.value
    return {tag: sorted(points.items()) for tag, points in series.items()}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


UNSMOOTHED = ("lr",)
"""Series drawn as they are, never averaged: the learning rate is a schedule, not a noisy measurement (an EMA would
draw a warm-up of 1 step as one of about 20)."""


def training_axis(run_dir: str | Path | None) -> str:
    """What the x-axis of a run's training curves counts: ``"epoch"`` for an online run (its loop logs once per epoch,
    `diffalign.train.online`), ``"step"`` (optimizer steps) otherwise. Read from the method of the run's saved config
    (``<run_dir>/.hydra/config.yaml``); ``"step"`` when there is none or it cannot be read."""
    if run_dir is None or not (Path(run_dir) / ".hydra" / "config.yaml").is_file():
        return "step"
    try:
        from hydra.utils import get_class
        from omegaconf import OmegaConf

        from diffalign.methods import ONLINE_FLOWS

        target = OmegaConf.load(Path(run_dir) / ".hydra" / "config.yaml").method._target_
        return "epoch" if getattr(get_class(target), "data_flow", None) in ONLINE_FLOWS else "step"
    except Exception:  # noqa: BLE001 (a config of another version, a plugin not installed here: the default axis)
        return "step"


def training_figure(tag: str, steps: list[int], values: list[float], x_label: str = "step"):
    """The matplotlib `Figure` of one training series against `x_label`: series of 20 points or more are drawn faint
    with an exponential moving average (weight 0.9) on top, except the `UNSMOOTHED` ones (the learning rate), drawn as
    they are."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.0, 2.8), dpi=100, layout="constrained")
    ax = fig.subplots()
    if len(steps) < 20 or tag.rsplit("/", 1)[-1] in UNSMOOTHED:
        ax.plot(steps, values, lw=1.2, marker="." if len(steps) < 20 else None)
    else:  # noisy per-step values: faint, with an exponential moving average (0.9) on top
        ax.plot(steps, values, lw=0.8, alpha=0.35, color="C0")
        smooth = [values[0]]
        for v in values[1:]:
            smooth.append(0.9 * smooth[-1] + 0.1 * v)
        ax.plot(steps, smooth, lw=1.5, color="C0", label="EMA 0.9")
        ax.legend(fontsize=8)
    ax.set_xlabel(x_label)
    ax.set_title(tag, fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def plot_training_curves(scalars: dict[str, list[tuple[int, float]]], out_dir: Path,
                         x_label: str = "step") -> list[Path]:
    """One PNG per scalar series (``train_<tag>.png``, `training_figure`), rewards first, then losses, then the rest,
    against `x_label` (``"epoch"`` for an online run, `training_axis`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for tag in sorted(scalars, key=lambda t: ("reward" not in t, "loss" not in t, t)):
        steps, values = zip(*scalars[tag])
        fig = training_figure(tag, list(steps), list(values), x_label)
        path = out_dir / f"train_{_slug(tag)}.png"
        atomic_file(path, fig.savefig, what=str(path))
        paths.append(path)
    return paths


def plot_eval_curves(metrics: dict, out_dir: Path) -> list[Path]:
    """Each reward's mean (and accuracy) with its bootstrap interval against the checkpoint step, for the evaluated
    ``checkpoint-<step>`` variants (at least two); the baseline as a dashed line. ``eval_<reward>.png``."""
    from matplotlib.figure import Figure

    stepped = sorted((s, label) for label, s in metrics["steps"].items() if s is not None)
    if len(stepped) < 2:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    base = metrics["labels"][0]
    paths = []
    for reward in _rewards(metrics):
        stats = [s for s in ("mean", "accuracy") if f"{reward}/{s}" in metrics["variants"][base]]
        fig = Figure(figsize=(4.0 * len(stats), 2.8), dpi=100, layout="constrained")
        for ax, stat in zip(fig.subplots(1, len(stats), squeeze=False)[0], stats):
            steps = [s for s, _ in stepped]
            values = [metrics["variants"][label][f"{reward}/{stat}"] for _, label in stepped]
            cis = [metrics["variants"][label][f"{reward}/{stat}_ci"] for _, label in stepped]
            ax.plot(steps, values, marker="o", lw=1.2, label="checkpoints")
            ax.fill_between(steps, [c[0] for c in cis], [c[1] for c in cis], alpha=0.2)
            if metrics["steps"][base] is None:
                ax.axhline(metrics["variants"][base][f"{reward}/{stat}"], ls="--", color="grey", label=base)
            ax.set_xlabel("training step")
            ax.set_title(f"{reward} {stat}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        path = out_dir / f"eval_{_slug(reward)}.png"
        atomic_file(path, fig.savefig, what=str(path))
        paths.append(path)
    return paths


def _fmt(value: float | None, ci: list | None = None, se: float | None = None) -> str:
    if value is None:
        return ""
    text = f"{value:.3f}"
    if se is not None:
        text += f" ± {se:.3f}"
    if ci is not None:
        text += f' <span class="ci">[{ci[0]:.3f}, {ci[1]:.3f}]</span>'
    return text


def _rewards(metrics: dict) -> list[str]:
    """The reward names of an evaluation, in metrics.json order."""
    return [k.split("/")[0] for k in metrics["variants"][metrics["labels"][0]] if k.count("/") == 1
            and k.endswith("/mean")]


def _metrics_table(metrics: dict) -> str:
    labels, base = metrics["labels"], metrics["labels"][0]
    first = metrics["variants"][base]
    rewards = _rewards(metrics)
    head = ["checkpoint"]
    for r in rewards:
        head.append(f"{r} mean")
        if f"{r}/accuracy" in first:
            head.append(f"{r} accuracy")
        head += [f"{r} win rate over {base}", f"{r} gain over {base}"]
    body = []
    for label in labels:
        v = metrics["variants"][label]
        cells = [html.escape(label)]
        cmp = metrics.get(f"{label}_vs_{base}", {})
        for r in rewards:
            cells.append(_fmt(v[f"{r}/mean"], v.get(f"{r}/mean_ci")))
            if f"{r}/accuracy" in first:
                cells.append(_fmt(v[f"{r}/accuracy"], v.get(f"{r}/accuracy_ci")))
            win = cmp.get(f"{r}/win_rate")
            gain = cmp.get(f"{r}/accuracy_gain") or cmp.get(f"{r}/mean_gain")
            cells.append(_fmt(win["win_rate"], win["ci"]) + f' <span class="ci">({win["wins"]}/{win["ties"]}/'
                         f'{win["losses"]})</span>' if win else "—")
            cells.append(_fmt(gain["gain"], se=gain["se"]) if gain else "—")
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ('<table id="metrics"><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")


def _tag_table(metrics: dict, samples: list[dict]) -> str:
    base = metrics["labels"][0]
    first = metrics["variants"][base]
    tags = ordered_tags([s for s in samples if s["variant"] == base])
    if not tags:
        return ""
    parts = []
    for key in sorted({k.rsplit("/", 1)[0] for k in first if k.count("/") == 2}, key=lambda k: ("accuracy" not in k, k)):
        stat = key.split("/")[1]
        head = ["checkpoint", *tags] + (["tag mean", "overall"] if stat == "accuracy" else ["overall"])
        rows = []
        for label in metrics["labels"]:
            v = metrics["variants"][label]
            cells = [html.escape(label)] + [_fmt(v[f"{key}/{t}"][stat], se=v[f"{key}/{t}"]["se"]) for t in tags]
            if stat == "accuracy":
                cells.append(_fmt(v[f"{key}_tag_mean"]))
            cells.append(_fmt(v[key], se=v[f"{key}_se" if stat == "accuracy" else f"{key.split('/')[0]}/se"]))
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        n_row = "<tr class=n><td>n images</td>" + "".join(f"<td>{first[f'{key}/{t}']['n']}</td>" for t in tags) \
            + "<td></td>" * (len(head) - 1 - len(tags)) + "</tr>"
        parts.append(f"<h3>{html.escape(key)} per tag (± standard error)</h3><table class=tags><thead><tr>"
                     + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr></thead><tbody>" + "".join(rows)
                     + n_row + "</tbody></table>")
    return "".join(parts)


STYLE = """
body { font-family: DejaVu Sans, Helvetica, Arial, sans-serif; margin: 24px; color: #1a1a1a; max-width: 1400px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; } h3 { font-size: 14px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th { background: #d9e4f0; text-align: left; }
th, td { border: 1px solid #b8c4d0; padding: 4px 8px; } tr.n td { color: #666; }
.ci { color: #666; font-size: 11px; }
.meta { color: #444; font-size: 13px; }
.plots img { margin: 4px; border: 1px solid #ddd; }
figure { display: inline-block; margin: 8px; vertical-align: top; }
figure img { image-rendering: pixelated; border: 1px solid #ccc; }
figcaption { font-size: 12px; max-width: 520px; }
"""


def write_report(eval_dir: str | Path, run_dir: str | Path | None = None, title: str | None = None) -> Path:
    """Writes ``<eval_dir>/report.html`` (and its plots under ``<eval_dir>/plots/``) and returns its path.

    Args:
        eval_dir: a folder written by `diffalign.evaluation.evaluate.evaluate_policy` (``metrics.json``,
        ``samples.jsonl``,
            ``grids/``).
        run_dir: the training run behind it; its ``logs/`` TensorBoard scalars become training-curve plots (none
            when None or when it has no event files).
        title: the page title (default: "diffalign evaluation — <eval_dir>").

    Raises:
        FileNotFoundError: when `eval_dir` holds no metrics.json (run the evaluation first).
    """
    eval_dir = Path(eval_dir)
    if not (eval_dir / "metrics.json").is_file():
        raise FileNotFoundError(f"{eval_dir} holds no metrics.json; run the evaluation (diffalign-eval or "
                                "evaluate_policy) into it first")
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    samples = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    plots_dir = eval_dir / "plots"
    train_plots = []
    if run_dir is not None and (Path(run_dir) / "logs").is_dir():
        # (the run's own evaluation, logged to the trackers as eval/<variant>/..., is in the tables below)
        scalars = {tag: v for tag, v in read_scalars(Path(run_dir) / "logs").items() if not tag.startswith("eval/")}
        train_plots = plot_training_curves(scalars, plots_dir, x_label=training_axis(run_dir))
    eval_plots = plot_eval_curves(metrics, plots_dir)
    title = title or f"diffalign evaluation — {eval_dir.resolve().name}"
    cfg = metrics.get("config", {})
    # metrics.json of an older version has no "sampler": its header named DDIM for every model; before eval.sampler
    # the config held num_inference_steps, guidance_scale and eta itself
    sampler = metrics.get("sampler") or f"{cfg.get('num_inference_steps')} DDIM steps, η {cfg.get('eta')}"
    guidance = (cfg.get("sampler") or {}).get("guidance_scale", cfg.get("guidance_scale"))

    out = [(f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>")]
    out.append(f"<p class=meta>prompts <b>{html.escape(str(metrics['prompts']))}</b>: {metrics['num_prompts']} "
               f"prompts × seeds {metrics['seeds']} = {metrics['num_prompts'] * len(metrics['seeds'])} images per "
               f"checkpoint; {html.escape(sampler)}, guidance {guidance}; intervals: {cfg.get('confidence', 0.95):.0%} prompt-level bootstrap "
               f"({cfg.get('bootstrap_resamples')} resamples, seed {cfg.get('bootstrap_seed')}); win rate: 1 per "
               f"(prompt, seed) where the checkpoint scores higher than {html.escape(metrics['labels'][0])}, 0.5 per "
               f"tie, 0 per loss (wins/ties/losses in brackets). Checkpoints: "
               + ", ".join(f"<b>{html.escape(k)}</b>" + ("" if v == k else f" = {html.escape(v)}")
                           for k, v in metrics["checkpoints"].items())
               + f". Written {datetime.now():%Y-%m-%d %H:%M}.</p>")
    out.append("<h2>Metrics</h2>" + _metrics_table(metrics))
    out.append(_tag_table(metrics, samples))
    if train_plots or eval_plots:
        out.append("<h2>Curves</h2><div class=plots>" + "".join(
            f'<img src="{quote(p.relative_to(eval_dir).as_posix())}" alt="{html.escape(p.stem)}">' for p in eval_plots + train_plots) + "</div>")
    out.append("<h2>Samples</h2><p class=meta>One grid per prompt: a row per checkpoint, a column per seed (the same "
               "initial noise in every row). Also: " + ", ".join(
                   f'<a href="{quote(name)}">{html.escape(label)} overview</a>'
                   for label, name in metrics.get("overview_grids", {}).items()) + ".</p>")
    rewards = _rewards(metrics)
    sums: dict[tuple[str, int], dict[str, float]] = {}
    videos: dict[int, list[dict]] = {}
    for row in samples:
        entry = sums.setdefault((row["variant"], row["prompt_index"]), dict.fromkeys(rewards, 0.0))
        for n in rewards:
            entry[n] += row[n] / len(metrics["seeds"])
        if "video" in row:
            videos.setdefault(row["prompt_index"], []).append(row)
    for k, grid in enumerate(metrics.get("grids", [])):
        p = grid["prompt_index"]
        lazy = ' loading="lazy"' if k >= MAX_EAGER_GRIDS else ""
        means = "; ".join(f"{html.escape(label)}: " + ", ".join(f"{n} {v:.2f}" for n, v in sums[label, p].items())
                          for label in metrics["labels"] if (label, p) in sums)
        tag = f' <span class=ci>[{html.escape(str(grid["tag"]))}]</span>' if grid.get("tag") else ""
        clips = "".join(
            (f'<video src="{quote(s["video"])}" autoplay loop muted width=128></video>' if s["video"].endswith(".mp4")
             else f'<img src="{quote(s["video"])}" width=128 alt="video">') for s in videos.get(p, []))
        out.append(f'<figure><img src="{quote(grid["path"])}"{lazy} alt="grid {p}"><figcaption>'
                   f'<b>{html.escape(grid["prompt"])}</b>{tag}<br><span class=ci>{means}</span>'
                   f"{'<br>' + clips if clips else ''}</figcaption></figure>")
    out.append("</body></html>")
    return write_text(eval_dir / "report.html", "\n".join(out), what=str(eval_dir / "report.html"))
