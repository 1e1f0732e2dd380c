"""Evaluation: generate for a prompt set with fixed per-image seeds, score with rewards, write grids and metrics.

The image for prompt ``p`` (its index in the prompt list) and seed ``s`` is generated with its own
``torch.Generator().manual_seed(image_seed(s, p))``, so the base model and every checkpoint see the same initial
noise, and any single image can be re-made alone. Seeds are written to ``samples.jsonl``.

`evaluate_policy` compares several variants of one policy (the adapter-disabled base, the policy as it is, LoRA
folders) on the same prompts and seeds, and resumes: each finished (variant, prompt) is appended to
``samples.jsonl`` with its images saved, and a re-run with the same settings skips it. Statistics (definitions in
``docs/guides/evaluation.md``): per-reward means with standard errors and prompt-level bootstrap intervals,
GenEval-style accuracy overall and per tag, paired gains and win rates of every variant over the first one.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import make_grid, save_image
from tqdm.auto import tqdm

from diffalign.console import console_summary, write
from diffalign.faults import stop_received
from diffalign.media import VIDEO_FORMATS, save_png, save_video
from diffalign.rewards.guard import checked_rewards
from diffalign.samplers.rollout import family_sampler, rollout
from diffalign.schemas import config_schema
from diffalign.stats import bootstrap_ci, paired_wins

TAG_ORDER = ("single_object", "colors", "counting", "two_object", "color_attr", "position")
LORA_FILE = "pytorch_lora_weights.safetensors"


@dataclass
class EvalConfig:
    """Evaluation settings (``eval`` in the Hydra config).

    Attributes:
        prompts: a shipped split (``"heldout"``, ``"train"``) or a path to a prompt file: GenEval metadata / plain
            jsonl, DrawBench / PartiPrompts-style csv or tsv, or plain txt (`diffalign.world.prompts.load_prompts`).
        prompts_per_tag: at most this many prompts per GenEval tag (all when None), chosen evenly through the file.
        seeds: seeds per prompt; the image seed is ``image_seed(seed, prompt_index)``.
        num_inference_steps, guidance_scale, eta: sampler settings (DDIM).
        batch_size: images per sampling batch.
        grid_images: how many images go into each variant's overview grid PNG.
        bootstrap_resamples, confidence, bootstrap_seed: the prompt-level bootstrap of every interval
            (`diffalign.stats.bootstrap_ci`).
        video_format: ``"gif"`` or ``"mp4"``, the file written per sample of a video model.
        reuse_base: take the base model's samples from an earlier evaluation beside this one (a sibling folder of
            the run folder, e.g. another ``runs/train-*/eval``) when it used the same base weights (hash of the
            frozen parameters), prompts, seeds, sampler and rewards, instead of sampling them again
            (`find_reusable_base`).
    """

    prompts: str = "heldout"
    prompts_per_tag: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    eta: float = 0.0
    batch_size: int = 64
    grid_images: int = 64
    bootstrap_resamples: int = 1000
    confidence: float = 0.95
    bootstrap_seed: int = 0
    video_format: str = "gif"
    reuse_base: bool = True


@config_schema("eval", "heldout")
@dataclass
class EvalGroupConfig(EvalConfig):
    """The ``eval`` group (``configs/eval/``): `EvalConfig`, and whether the training loops evaluate at the end.

    Attributes:
        enabled: evaluate the base and the fine-tuned model after training (``diffalign-train``; ``diffalign-eval``
            ignores it).
    """

    enabled: bool = True


def eval_config_from(node) -> EvalConfig:
    """`EvalConfig` from the Hydra ``eval`` node (its ``enabled`` switch belongs to the training loop)."""
    from omegaconf import OmegaConf

    return EvalConfig(**{k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "enabled"})


def image_seed(seed: int, prompt_index: int) -> int:
    """The generator seed of the image for `prompt_index` under `seed`."""
    return seed * 1_000_003 + prompt_index


def select_prompts(rows: list[dict], prompts_per_tag: int | None) -> list[dict]:
    """At most `prompts_per_tag` rows per tag, evenly spaced through each tag's rows (rows without a tag count as
    one tag)."""
    if prompts_per_tag is None:
        return list(rows)
    if prompts_per_tag < 1:
        raise ValueError(f"eval.prompts_per_tag must be >= 1 or null, got {prompts_per_tag}")
    by_tag: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_tag[r.get("tag", "all")].append(r)
    out = []
    for tag_rows in by_tag.values():
        n = min(prompts_per_tag, len(tag_rows))
        out += [tag_rows[math.floor(i * len(tag_rows) / n)] for i in range(n)]
    return out


def resolve_checkpoints(specs: list[str]) -> dict[str, bool | Path]:
    """Variants for `evaluate_policy` from a checkpoint list such as ``[base, runs/x/final, runs/x]``.

    ``base`` is the adapter-disabled model (``True``); a folder holding ``pytorch_lora_weights.safetensors`` is one
    checkpoint, labelled ``<parent>/<folder>`` (``x/final``); a run folder holding ``checkpoint-<step>/`` folders
    expands to them in step order (its ``final/`` equals the last checkpoint and is not added).

    Raises:
        ValueError: for an empty list or a checkpoint listed twice (two equal labels).
        FileNotFoundError: for an entry that is neither ``base``, a LoRA folder nor a run folder.
    """
    if not specs:
        raise ValueError("checkpoints is empty; pass e.g. checkpoints=[base,runs/my-run/final]")
    variants: dict[str, bool | Path] = {}

    def add(label: str, value: bool | Path) -> None:
        if label in variants:
            raise ValueError(f"checkpoint {label!r} is listed twice in checkpoints={list(specs)}; list it once")
        variants[label] = value

    for spec in specs:
        spec = str(spec)
        if spec == "base":
            add("base", True)
            continue
        path = Path(spec)
        if (path / LORA_FILE).is_file():
            add(f"{path.resolve().parent.name}/{path.name}", path)
            continue
        steps = sorted((int(m.group(1)), p) for p in path.glob("checkpoint-*")
                       if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / LORA_FILE).is_file())
        if not steps:
            raise FileNotFoundError(f"checkpoints: {spec!r} is neither 'base', a folder holding {LORA_FILE} (a "
                                    "checkpoint-<step>/ or final/ folder) nor a run folder holding checkpoint-<step>/ "
                                    "folders")
        for _, p in steps:
            add(f"{path.resolve().name}/{p.name}", p)
    return variants


def checkpoint_step(label: str) -> int | None:
    """The training step of a ``.../checkpoint-<step>`` label, else None."""
    m = re.search(r"checkpoint-(\d+)$", label)
    return int(m.group(1)) if m else None


@torch.no_grad()
def generate(policy, rows: list[dict], seeds: list[int], cfg: EvalConfig, use_reference: bool = False):
    """Images `(N, 3, H, W)` in [0, 1] for every (seed, prompt) and their records (prompt, seed, image_seed, tag).

    With `use_reference` the policy samples under ``policy.reference()`` (the adapter-disabled base model).
    """
    jobs = [(s, p, row) for s in seeds for p, row in enumerate(rows)]
    images, records = [], []
    for start in range(0, len(jobs), cfg.batch_size):
        chunk = jobs[start:start + cfg.batch_size]
        images.append(_sample(policy, [(p, s) for s, p, _ in chunk], rows, cfg, use_reference))
        records += [{"prompt": row["prompt"], "seed": s, "image_seed": image_seed(s, p), "prompt_index": p,
                     "tag": row.get("tag")} for s, p, row in chunk]
    return torch.cat(images), records


def _sample(policy, jobs: list[tuple[int, int]], rows: list[dict], cfg: EvalConfig, use_reference: bool):
    """Images for the (prompt_index, seed) `jobs`, each from its own generator; float32 on the CPU."""
    gens = [torch.Generator(device="cpu").manual_seed(image_seed(s, p)) for p, s in jobs]
    prompts = [rows[p]["prompt"] for p, _ in jobs]
    sampler = family_sampler(policy, num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale,
                             noise=cfg.eta)
    if use_reference:
        with policy.reference():
            traj = rollout(policy, prompts, sampler, generator=gens, fuse_lora=True)
    else:
        traj = rollout(policy, prompts, sampler, generator=gens, fuse_lora=True)
    return traj.images.float().cpu()


def sampler_description(policy, cfg: EvalConfig) -> str:
    """The evaluation's sampler in words, for the report's header: ``"20 DDIM steps, η 0.0"`` for a `DDIMScheduler`
    policy, ``"20 Euler ODE steps"`` (η = 0) or ``"20 flow SDE steps (Flow-GRPO's, a = 0.7)"`` for a rectified-flow one
    (`rollout`'s choice of sampler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    steps = cfg.num_inference_steps
    if isinstance(getattr(policy, "scheduler", None), FlowMatchEulerDiscreteScheduler):
        return f"{steps} Euler ODE steps" if cfg.eta == 0 else f"{steps} flow SDE steps (Flow-GRPO's, a = {cfg.eta})"
    return f"{steps} DDIM steps, η {cfg.eta}"


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def score(rewards: dict, images: torch.Tensor, rows: list[dict], records: list[dict]) -> dict[str, dict]:
    """Runs every reward on the images; returns ``{reward name: {"scores": [...], "correct": [...]?}}``."""
    by_prompt = {r["prompt"]: r for r in rows}
    return _score(rewards, images, [rec["prompt"] for rec in records], [by_prompt[rec["prompt"]] for rec in records])


def _score(rewards: dict, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, dict]:
    """Every reward's scores (and correctness) of a batch, each call checked (`diffalign.rewards.guard.CheckedReward`;
    rewards given unguarded are wrapped, guarded ones keep the step they name in errors)."""
    out = {}
    for name, reward in checked_rewards(rewards).items():
        res = reward(images, prompts, metadata)
        entry = {"scores": res.scores.float().tolist()}
        if "correct" in res.info:
            entry["correct"] = [bool(c) for c in res.info["correct"]]
            entry["failed"] = res.info.get("failed")
        out[name] = entry
    return out


def _tags(records: list[dict]) -> list[str]:
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
    tags = _tags(records)
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

    - ``name/accuracy_gain`` (rewards with correctness) or ``name/mean_gain``: the paired difference b − a with its
      standard error and their ratio;
    - ``name/win_rate``: the mean over (prompt, seed) pairs of 1 (b's score higher), 0.5 (equal) or 0 (lower)
      (`diffalign.stats.paired_wins`; identical variants give exactly 0.5), with counts and a prompt-level bootstrap
      interval over `groups` (the prompt index of each pair; each pair its own group when None).
    """
    out = {}
    for name, entry_a in scored_a.items():
        key = "correct" if "correct" in entry_a else "scores"
        diff = [float(b) - float(a) for a, b in zip(entry_a[key], scored_b[name][key])]
        m, se = _mean_se(diff)
        metric = "accuracy" if key == "correct" else "mean"
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


def write_grid(images: torch.Tensor, path: Path, nrow: int = 8) -> None:
    """Saves up to len(images) images `(N, 3, H, W)` in [0, 1] as one PNG grid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images.clamp(0, 1), nrow=nrow, padding=1, pad_value=0.5), path)


def prompt_grid(cells: list[list[Image.Image]], row_labels: list[str], col_labels: list[str], title: str,
                min_cell: int = 128) -> Image.Image:
    """One labelled PNG-ready grid: a row per checkpoint (`row_labels`), a column per seed (`col_labels`) and the
    prompt as `title`. Small images are enlarged by an integer factor (nearest neighbour) to at least `min_cell`
    pixels, so that 32×32 images stay readable."""
    w, h = cells[0][0].size
    scale = max(1, math.ceil(min_cell / max(w, h)))
    cw, ch = w * scale, h * scale
    font = ImageFont.load_default(size=13)
    pad = 4
    left = max(int(font.getlength(t)) for t in row_labels) + 2 * pad
    width = left + len(col_labels) * (cw + pad) + pad
    title_lines, line = [], ""
    for word in title.split():  # wrap the prompt to the grid's width
        if line and font.getlength(f"{line} {word}") > width - 2 * pad:
            title_lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    title_lines.append(line)
    top = 18 * len(title_lines) + 18 + pad
    canvas = Image.new("RGB", (width, top + len(row_labels) * (ch + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for k, text in enumerate(title_lines):
        draw.text((pad, pad + 18 * k), text, fill="black", font=font)
    for j, text in enumerate(col_labels):
        draw.text((left + j * (cw + pad), top - 18), text, fill="black", font=font)
    for i, (text, images) in enumerate(zip(row_labels, cells)):
        y = top + i * (ch + pad)
        draw.text((pad, y + ch // 2 - 7), text, fill="black", font=font)
        for j, im in enumerate(images):
            canvas.paste(im.convert("RGB").resize((cw, ch), Image.NEAREST), (left + j * (cw + pad), y))
    return canvas


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)


def _fingerprint(policy, spec: bool | str | Path) -> str:
    """What a variant samples from: the adapter-disabled base, the hash of the policy's trainable parameters
    (the policy as it is), or the hash of a LoRA file. A re-run reuses a variant's samples only for an equal one."""
    digest = hashlib.sha256()
    if spec is True:
        return f"adapter-disabled:{base_weights_hash(policy)}"
    if spec is False:
        for p in policy.trainable_parameters():
            digest.update(p.detach().float().cpu().clone().numpy().tobytes())  # (a copy: see below)
        return f"policy:{digest.hexdigest()[:16]}"
    digest.update((Path(spec) / LORA_FILE).read_bytes())
    return f"lora:{digest.hexdigest()[:16]}"


def base_weights_hash(policy) -> str:
    """A 16-hex-digit SHA-256 of the policy's frozen weights (every parameter and buffer of its modules except LoRA
    adapters and trainable parameters): what the adapter-disabled base samples from. Cached on the policy per
    (name, shape, dtype, data pointer, version) signature, so it is computed once per run."""
    trainable = {id(p) for p in policy.trainable_parameters()}
    tensors = [(name, t) for name, t in sorted(policy.state_dict(keep_vars=True).items())
               if id(t) not in trainable and ".lora_" not in name]
    signature = tuple((name, tuple(t.shape), str(t.dtype), t.data_ptr(), t._version) for name, t in tensors)
    cached = policy.__dict__.get("_base_weights_hash")
    if cached is not None and cached[0] == signature:
        return cached[1]
    digest = hashlib.sha256()
    for name, t in sorted((n.replace(".base_layer.", "."), t) for n, t in tensors):  # a LoRA-wrapped layer's
        digest.update(name.encode())                                                # weight is ...base_layer.weight
        # (from a copy: .numpy() of a weight's own storage marks it not resizable, and FSDP's summon_full_params
        # can then not free its gathered weights: "Trying to resize storage that is not resizable")
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).clone().numpy().tobytes())
    policy.__dict__["_base_weights_hash"] = (signature, digest.hexdigest()[:16])
    return digest.hexdigest()[:16]


def base_reuse_key(model_cfg, reward_cfg) -> dict:
    """The settings besides the weights that decide the base model's samples and scores: the model config without
    its LoRA fields (``num_frames``, ``max_sequence_length``, dtype, ...) and the reward configs (e.g. a verifier's
    ``score=binary``). Plain JSON-able dicts from OmegaConf nodes or dicts."""
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})

    model = {k: v for k, v in plain(model_cfg).items() if not k.startswith("lora_") and k != "init_lora"}
    return json.loads(json.dumps({"model": model, "rewards": plain(reward_cfg)}, sort_keys=True, default=str))


def find_reusable_base(out_dir: Path, key: dict, fingerprint: str, num_rows: int, seeds: list[int],
                       max_candidates: int = 64, *, base_key: dict | None = None) -> tuple[Path, list[dict]] | None:
    """An earlier, finished evaluation of the same base model beside `out_dir`, and its samples of that base.

    Looks at ``<root>/*/eval_state.json`` and ``<root>/*/eval/eval_state.json``, where ``<root>`` is the folder that
    holds the run folder (``runs/`` for ``runs/train-<time>/eval`` and for ``runs/eval-<time>``), newest first, at
    most `max_candidates`. A candidate qualifies when its resume key equals `key` apart from ``context`` (same
    prompts, seeds, sampler, rewards, video format), its `base_key` equals `base_key` (model and reward settings,
    `base_reuse_key`), one of its variants has `fingerprint` (the same frozen base weights, `base_weights_hash`), and
    that variant has every (prompt, seed) sample with its image file.

    Returns:
        ``(folder, samples)`` of the first qualifying evaluation, or None.
    """
    out_dir = Path(out_dir).resolve()
    root = out_dir.parent.parent if out_dir.name == "eval" else out_dir.parent
    found = [p for pattern in ("*/eval_state.json", "*/eval/eval_state.json") for p in root.glob(pattern)]
    found = sorted((p for p in found if p.parent.resolve() != out_dir), key=lambda p: p.stat().st_mtime,
                   reverse=True)[:max_candidates]
    wanted = {k: v for k, v in key.items() if k != "context"}
    for state_path in found:
        try:
            state = json.loads(state_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if {k: v for k, v in state.get("key", {}).items() if k != "context"} != wanted:
            continue
        if base_key is None or state.get("base_key") != base_key:
            continue
        labels = [label for label, fp in state.get("fingerprints", {}).items() if fp == fingerprint]
        if not labels:
            continue
        folder = state_path.parent
        rows = [s for s in _read_samples(folder / "samples.jsonl") if s.get("variant") == labels[0]]
        have = {(s["prompt_index"], s["seed"]) for s in rows}
        if have != {(p, s) for p in range(num_rows) for s in seeds}:
            continue
        if all((folder / s["image"]).is_file() and ("video" not in s or (folder / s["video"]).is_file())
               for s in rows):
            return folder, rows
    return None


def _adopt_base(source: Path, rows: list[dict], out_dir: Path, label: str, slug: str) -> list[dict]:
    """Copies the reused base samples' files into `out_dir` under this evaluation's variant `label`."""
    import shutil

    adopted = []
    for row in rows:
        row = dict(row, variant=label)
        for field_name in ("image", "video"):
            if field_name in row:
                name = Path(row[field_name]).name
                target = f"images/{slug}/{name}"
                (out_dir / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source / row[field_name], out_dir / target)
                row[field_name] = target
        adopted.append(row)
    return adopted


def _read_samples(path: Path) -> list[dict]:
    """Rows of a samples.jsonl; a last line cut short by an interruption is dropped."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _write_samples(path: Path, samples: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(s) + "\n" for s in samples))
    tmp.replace(path)


def evaluate_policy(policy, rows: list[dict], rewards: dict, cfg: EvalConfig, out_dir: Path,
                    variants: dict[str, bool | str | Path], log=write, *, resume: bool = True,
                    context: dict | None = None, progress: bool = True, base_key: dict | None = None) -> dict:
    """Generates and scores each variant on `rows` with identical per-image seeds, and writes under `out_dir`:

    - ``images/<variant>/p<prompt_index>_s<seed>.png`` (and ``.gif``/``.mp4`` for video models, whose images are
      `(N, F, 3, H, W)`; the PNG then holds the first frame);
    - ``samples.jsonl`` (one row per image: variant, prompt, tag, seed, image_seed, prompt_index, image path, every
      reward's score and correctness), ``<variant>_grid.png`` (the first ``cfg.grid_images`` images),
      ``grids/p<prompt_index>.png`` (one labelled grid per prompt: a row per variant, a column per seed);
    - ``metrics.json`` (`summarize` per variant, `compare` of every variant against the first one) and
      ``metrics.csv`` (the same numbers, one row per statistic).

    Args:
        policy: a `DiffusionPolicy` with ``reference()`` and, for LoRA folders, ``load_lora_weights(dir)``.
        rows: prompt rows (``prompt`` and optional GenEval metadata / ``tag``), non-empty.
        rewards: ``{name: reward}``; every reward scores every image.
        cfg: the sampler, seeds and statistics settings.
        variants: ``{label: spec}`` in order, the first one being the baseline of gains and win rates. ``True``:
            the adapter-disabled base (``policy.reference()``); ``False``: the policy as it is at that point;
            a folder (`str`/`Path`): its LoRA is loaded into the policy (which keeps it afterwards) and sampled.
        log: prints one summary line per variant (default: `diffalign.console.write`, around the progress bar).
        resume: reuse the finished (variant, prompt) samples of an earlier run in `out_dir` when the prompts,
            seeds, sampler settings, rewards and `context` are equal and the variant samples from the same weights
            (a changed variant is recomputed); False starts over.
        context: JSON-able description of what is evaluated (e.g. the model config): part of the resume key and
            written to metrics.json.
        progress: show a tqdm bar over (variant, prompt) pairs.
        base_key: what else determines the base's samples and scores besides its weights, prompts, seeds and
            sampler (`base_reuse_key`: the model config without its LoRA fields, the reward configs); the base is
            reused from a sibling evaluation (``cfg.reuse_base``) only when it is given and equal. None: no reuse.

    Returns:
        The metrics written to metrics.json.

    Raises:
        ValueError: for no rows, no variants, two labels with the same file name, or an unknown video format.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise ValueError("eval.prompts selected no prompts; point eval.prompts at a non-empty file")
    if not variants:
        raise ValueError("no variants to evaluate; pass e.g. {'base': True}")
    if cfg.video_format not in VIDEO_FORMATS:
        raise ValueError(f"eval.video_format must be one of {VIDEO_FORMATS}, got {cfg.video_format!r}")
    labels = list(variants)
    slugs = {label: _slug(label) for label in labels}
    if len(set(slugs.values())) != len(labels):
        raise ValueError(f"variant labels {labels} map to the same folder names {list(slugs.values())}; rename them")
    seeds = list(cfg.seeds)

    # resume: the key says which earlier samples are valid, the fingerprints which variants they came from
    key = {"prompts": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16], "seeds": seeds,
           "num_inference_steps": cfg.num_inference_steps, "guidance_scale": cfg.guidance_scale, "eta": cfg.eta,
           "rewards": sorted(rewards), "video_format": cfg.video_format, "context": context}
    state_path, samples_path = out_dir / "eval_state.json", out_dir / "samples.jsonl"
    state, samples = _earlier_state(out_dir, key, resume, log)
    state["base_key"] = base_key
    _write_samples(samples_path, samples)

    # repeating warnings (e.g. prompts longer than a text encoder's context): one summary line per variant
    with console_summary() as warnings:
        bar = tqdm(total=len(labels) * len(rows), desc="eval", unit="prompt", disable=not progress)
        for label in labels:
            spec = variants[label]
            fingerprint = _fingerprint(policy, spec)
            if state["fingerprints"].get(label) != fingerprint:
                samples = [s for s in samples if s["variant"] != label]
                reusable = find_reusable_base(out_dir, key, fingerprint, len(rows), seeds, base_key=base_key) \
                    if spec is True and cfg.reuse_base and base_key is not None else None
                if reusable is not None:
                    samples += _adopt_base(reusable[0], reusable[1], out_dir, label, slugs[label])
                    log(f"eval {label}: reusing the identical base evaluation in {reusable[0]} (same base weights, "
                        "prompts, seeds, sampler and rewards; eval.reuse_base=false samples it again)")
            state["fingerprints"][label] = fingerprint
            state_path.write_text(json.dumps(state, indent=2))
            # a prompt counts as finished only with all its seeds (rows of one prompt are written together)
            per_prompt = defaultdict(set)
            for s in samples:
                if s["variant"] == label:
                    per_prompt[s["prompt_index"]].add(s["seed"])
            pending = [p for p in range(len(rows)) if per_prompt.get(p) != set(seeds)]
            redo = set(pending)  # (rows of a prompt cut short by an interruption are made again)
            samples = [s for s in samples if s["variant"] != label or s["prompt_index"] not in redo]
            _write_samples(samples_path, samples)
            bar.update(len(rows) - len(pending))
            bar.set_postfix(variant=label)
            if pending and spec not in (True, False):
                policy.load_lora_weights(spec)
            jobs = [(p, s) for p in pending for s in seeds]
            buffer: dict[int, list[dict]] = defaultdict(list)
            with samples_path.open("a") as f:
                for start in range(0, len(jobs), cfg.batch_size):
                    stop = stop_received()  # SIGTERM / SIGINT: stop here; the finished prompts are in samples.jsonl
                    if stop is not None:
                        bar.close()
                        finished = sum(1 for s in samples if s["variant"] in labels) // len(seeds)
                        raise stop.interrupted(f"during the evaluation ({finished} of {len(labels) * len(rows)} "
                                               f"(variant, prompt) evaluations finished, kept in {out_dir})")
                    chunk = jobs[start:start + cfg.batch_size]
                    images = _sample(policy, chunk, rows, cfg, use_reference=spec is True)
                    prompts, metadata = [rows[p]["prompt"] for p, _ in chunk], [rows[p] for p, _ in chunk]
                    scored = _score(rewards, images, prompts, metadata)
                    for i, (p, s) in enumerate(chunk):
                        buffer[p].append(_save_sample(images, scored, i, label, slugs[label], rows, p, s, cfg,
                                                      out_dir))
                        if len(buffer[p]) == len(seeds):
                            f.write("".join(json.dumps(r) + "\n" for r in buffer[p]))
                            f.flush()
                            samples += buffer.pop(p)
                            bar.update(1)
            warnings.flush(f"eval {label}")
        bar.close()

    # statistics, grids and tables from the samples (finished in this run or an earlier one)
    return _write_metrics(samples, rows, variants, rewards, cfg, out_dir, slugs, log, context,
                          sampler_description(policy, cfg))


def _earlier_state(out_dir: Path, key: dict, resume: bool, log) -> tuple[dict, list[dict]]:
    """The state and finished samples of an earlier evaluation in `out_dir` made with the same `key` (when
    `resume`), else a fresh state and no samples (saying so when the settings differ)."""
    state_path = out_dir / "eval_state.json"
    state = json.loads(state_path.read_text()) if resume and state_path.is_file() else None
    if state is not None and state.get("key") != key:
        log(f"eval: the settings differ from the earlier evaluation in {out_dir}; starting over")
        state = None
    if state is None:
        return {"key": key, "fingerprints": {}}, []
    return state, _read_samples(out_dir / "samples.jsonl")


def _save_sample(images: torch.Tensor, scored: dict, i: int, label: str, slug: str, rows: list[dict], p: int, s: int,
                 cfg: EvalConfig, out_dir: Path) -> dict:
    """Saves image (or video) `i` of a batch, prompt `p` with seed `s`, under ``images/<slug>/``; returns its
    ``samples.jsonl`` record with every reward's score and correctness."""
    stem = f"images/{slug}/p{p:05d}_s{s}"
    record = {"variant": label, "prompt": rows[p]["prompt"], "seed": s, "image_seed": image_seed(s, p),
              "prompt_index": p, "tag": rows[p].get("tag"), "image": f"{stem}.png"}
    if images.ndim == 5:  # a video (F, C, H, W): the file, and its first frame for the grids
        record["video"] = str(save_video(images[i], out_dir / f"{stem}.{cfg.video_format}").relative_to(out_dir))
        save_png(images[i, 0], out_dir / record["image"])
    else:
        save_png(images[i], out_dir / record["image"])
    record.update({n: e["scores"][i] for n, e in scored.items()})
    record.update({f"{n}/correct": e["correct"][i] for n, e in scored.items() if "correct" in e})
    return record


def _write_metrics(samples: list[dict], rows: list[dict], variants: dict, rewards: dict, cfg: EvalConfig,
                   out_dir: Path, slugs: dict[str, str], log, context: dict | None, sampler: str | None = None) -> dict:
    """`evaluate_policy`'s last stage: the sorted ``samples.jsonl``, the statistics of each variant and its comparison
    with the first, the overview and per-prompt grids, ``metrics.json`` and ``metrics.csv``; returns the metrics."""
    labels, seeds = list(variants), list(cfg.seeds)
    order = {label: k for k, label in enumerate(labels)}
    samples = sorted((s for s in samples if s["variant"] in order),
                     key=lambda s: (order[s["variant"]], s["seed"], s["prompt_index"]))
    _write_samples(out_dir / "samples.jsonl", samples)
    by_variant = {label: [s for s in samples if s["variant"] == label] for label in labels}
    boot = {"num_resamples": cfg.bootstrap_resamples, "confidence": cfg.confidence, "seed": cfg.bootstrap_seed}
    scored_all = {}
    metrics: dict = {"prompts": cfg.prompts, "num_prompts": len(rows), "seeds": seeds, "labels": labels,
                     "checkpoints": {label: str(v) if v not in (True, False) else ("base" if v else "policy")
                                     for label, v in variants.items()},
                     "steps": {label: checkpoint_step(label) for label in labels}, "config": asdict(cfg),
                     "sampler": sampler, "context": context, "variants": {}}
    for label in labels:
        records = by_variant[label]
        scored_all[label] = {n: {"scores": [r[n] for r in records],
                                 **({"correct": [r[f"{n}/correct"] for r in records]}
                                    if f"{n}/correct" in records[0] else {})} for n in rewards}
        metrics["variants"][label] = summarize(scored_all[label], records, **boot)
        grid = [torch.from_numpy(np.array(Image.open(out_dir / r["image"]).convert("RGB"))).permute(2, 0, 1) / 255
                for r in records[: cfg.grid_images]]
        write_grid(torch.stack(grid), out_dir / f"{slugs[label]}_grid.png")
        metrics.setdefault("overview_grids", {})[label] = f"{slugs[label]}_grid.png"
        log(f"eval {label}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics["variants"][label].items()
                                          if isinstance(v, float)))
    groups = [r["prompt_index"] for r in by_variant[labels[0]]]
    for other in labels[1:]:
        metrics[f"{other}_vs_{labels[0]}"] = compare(scored_all[labels[0]], scored_all[other], labels[0], other,
                                                     groups=groups, **boot)
    metrics["grids"] = []
    cell = {(s["variant"], s["prompt_index"], s["seed"]): s["image"] for s in samples}
    for p, row in enumerate(rows):
        cells = [[Image.open(out_dir / cell[label, p, s]) for s in seeds] for label in labels]
        path = out_dir / "grids" / f"p{p:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        prompt_grid(cells, labels, [f"seed {s}" for s in seeds], row["prompt"]).save(path)
        metrics["grids"].append({"prompt_index": p, "prompt": row["prompt"], "tag": row.get("tag"),
                                 "path": str(path.relative_to(out_dir))})
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_metrics_csv(metrics, out_dir / "metrics.csv")
    return metrics


def metrics_table(metrics: dict) -> list[dict]:
    """metrics.json as flat rows ``{checkpoint, metric, tag, value, se, ci_low, ci_high, n}`` (the CSV's rows): each
    variant's statistics, then each comparison's gains and win rates (``checkpoint`` = the compared variant)."""
    out = []

    def add(checkpoint, metric, value, se=None, ci=None, n=None, tag=None):
        out.append({"checkpoint": checkpoint, "metric": metric, "tag": tag, "value": value, "se": se,
                    "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None, "n": n})

    for label, summary in metrics["variants"].items():
        n = summary["num_images"]
        for k, v in summary.items():
            parts = k.split("/")
            if len(parts) == 2 and parts[1] in ("mean", "accuracy"):
                se_key = f"{parts[0]}/se" if parts[1] == "mean" else f"{k}_se"
                add(label, k, v, summary[se_key], summary.get(f"{k}_ci"), n)
            elif len(parts) == 2 and parts[1] == "accuracy_tag_mean":
                add(label, k, v)
            elif len(parts) == 3:
                add(label, "/".join(parts[:2]), v[parts[1]], v["se"], v.get("ci"), v["n"], tag=parts[2])
    for label in metrics["labels"][1:]:
        for k, v in metrics.get(f"{label}_vs_{metrics['labels'][0]}", {}).items():
            if k.endswith("/win_rate"):
                add(label, k, v["win_rate"], ci=v["ci"], n=v["n"])
            else:
                add(label, k, v["gain"], v["se"])
    return out


def comparison_lines(metrics: dict) -> list[str]:
    """One line per compared variant for the console: each statistic's paired gain ± s.e. against the first variant
    and each reward's win rate with its interval, e.g. ``finetuned vs base: geneval_shapes/mean +0.071 ± 0.018 (4.0
    s.e.); geneval_shapes/win_rate 0.61 [0.55, 0.67]`` (metrics.json / metrics.csv hold every figure)."""
    base, lines = metrics["labels"][0], []
    for label in metrics["labels"][1:]:
        parts = []
        for k, v in metrics.get(f"{label}_vs_{base}", {}).items():
            if k.endswith("/win_rate"):
                parts.append(f"{k} {v['win_rate']:.2f} [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]")
            else:
                ratio = f" ({v['gain'] / v['se']:.1f} s.e.)" if v.get("se") else ""
                parts.append(f"{k} {v['gain']:+.3f} ± {v['se']:.3f}{ratio}")
        lines.append(f"{label} vs {base}: " + "; ".join(parts))
    return lines


def write_metrics_csv(metrics: dict, path: Path) -> None:
    """Writes `metrics_table(metrics)` as a CSV with a header row."""
    rows = metrics_table(metrics)
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["checkpoint", "metric", "tag", "value", "se", "ci_low", "ci_high", "n"])
        writer.writeheader()
        writer.writerows(rows)
