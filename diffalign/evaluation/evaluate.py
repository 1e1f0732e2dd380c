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

import contextlib
import dataclasses
import hashlib
import json
from collections import defaultdict
from pathlib import Path

from tqdm.auto import tqdm

from diffalign.evaluation.files import (
    adopt_base,
    earlier_state,
    find_reusable_base,
    label_slug,
    save_sample,
    variant_fingerprint,
    write_samples,
)
from diffalign.evaluation.generation import EvalConfig, eval_sampler, sample_images, sampler_description
from diffalign.evaluation.metrics import write_metrics
from diffalign.evaluation.scoring import score_batch
from diffalign.runtime.console import console_summary, write
from diffalign.runtime.faults import stop_received
from diffalign.runtime.media import VIDEO_FORMATS
from diffalign.runtime.storage import disk_full_as_error, write_text


def check_inputs(rows: list[dict], variants: dict, cfg: EvalConfig) -> tuple[list[str], dict[str, str]]:
    """The variant labels and their folder names (`label_slug`), after `evaluate_policy`'s input checks.

    Raises:
        ValueError: for no rows, no variants, two labels with the same folder name, or an unknown video format.
    """
    if not rows:
        raise ValueError("eval.prompts selected no prompts; point eval.prompts at a non-empty file")
    if not variants:
        raise ValueError("no variants to evaluate; pass e.g. {'base': True}")
    if cfg.video_format not in VIDEO_FORMATS:
        raise ValueError(f"eval.video_format must be one of {VIDEO_FORMATS}, got {cfg.video_format!r}")
    labels = list(variants)
    slugs = {label: label_slug(label) for label in labels}
    if len(set(slugs.values())) != len(labels):
        raise ValueError(f"variant labels {labels} map to the same folder names {list(slugs.values())}; rename them")
    return labels, slugs


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
        cfg: the sampler (``cfg.sampler``, `eval_sampler`), seeds and statistics settings.
        variants: ``{label: spec}`` in order, the first one being the baseline of gains and win rates. ``True``:
            the adapter-disabled base (``policy.reference()``); ``False``: the policy as it is at that point;
            a folder (`str`/`Path`): its LoRA is loaded into the policy (which keeps it afterwards) and sampled.
        log: prints one summary line per variant (default: `diffalign.runtime.console.write`, around the progress bar).
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
        DiskFullError: the disk filled up (naming the file; nothing half-written is kept, a re-run continues).
    """
    labels, slugs = check_inputs(rows, variants, cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(cfg.seeds)
    cfg = dataclasses.replace(cfg, sampler=eval_sampler(cfg))  # (a bad node fails here, before any sampling)

    # resume: the key says which earlier samples are valid, the fingerprints which variants they came from
    key = {"prompts": hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16], "seeds": seeds,
           "sampler": dataclasses.asdict(cfg.sampler),
           "rewards": sorted(rewards), "video_format": cfg.video_format, "context": context}
    state_path, samples_path = out_dir / "eval_state.json", out_dir / "samples.jsonl"
    state, samples = earlier_state(out_dir, key, resume, log)
    state["base_key"] = base_key
    write_samples(samples_path, samples)

    # repeating warnings (e.g. prompts longer than a text encoder's context): one summary line per variant
    bar = tqdm(total=len(labels) * len(rows), desc="eval", unit="prompt", disable=not progress)
    with console_summary() as warnings, contextlib.closing(bar):  # (closed on errors too: their line comes last)
        for label in labels:
            spec = variants[label]
            fingerprint = variant_fingerprint(policy, spec)
            if state["fingerprints"].get(label) != fingerprint:
                samples = [s for s in samples if s["variant"] != label]
                reusable = find_reusable_base(out_dir, key, fingerprint, len(rows), seeds, base_key=base_key) \
                    if spec is True and cfg.reuse_base and base_key is not None else None
                if reusable is not None:
                    samples += adopt_base(reusable[0], reusable[1], out_dir, label, slugs[label])
                    log(f"eval {label}: reusing the identical base evaluation in {reusable[0]} (same base weights, "
                        "prompts, seeds, sampler and rewards; eval.reuse_base=false samples it again)")
            state["fingerprints"][label] = fingerprint
            write_text(state_path, json.dumps(state, indent=2), what=str(state_path))
            # a prompt counts as finished only with all its seeds (rows of one prompt are written together)
            per_prompt = defaultdict(set)
            for s in samples:
                if s["variant"] == label:
                    per_prompt[s["prompt_index"]].add(s["seed"])
            pending = [p for p in range(len(rows)) if per_prompt.get(p) != set(seeds)]
            redo = set(pending)  # (rows of a prompt cut short by an interruption are made again)
            samples = [s for s in samples if s["variant"] != label or s["prompt_index"] not in redo]
            write_samples(samples_path, samples)
            bar.update(len(rows) - len(pending))
            bar.set_postfix(variant=label)
            if pending and spec not in (True, False):
                policy.load_lora_weights(spec)
            jobs = [(p, s) for p in pending for s in seeds]
            buffer: dict[int, list[dict]] = defaultdict(list)
            # (a full disk: the half-written image is removed and a partial line is dropped when read back)
            with disk_full_as_error(out_dir, str(samples_path)), samples_path.open("a") as f:
                for start in range(0, len(jobs), cfg.batch_size):
                    stop = stop_received()  # SIGTERM / SIGINT: stop here; the finished prompts are in samples.jsonl
                    if stop is not None:
                        bar.close()
                        finished = sum(1 for s in samples if s["variant"] in labels) // len(seeds)
                        raise stop.interrupted(f"during the evaluation ({finished} of {len(labels) * len(rows)} "
                                               f"(variant, prompt) evaluations finished, kept in {out_dir})")
                    chunk = jobs[start:start + cfg.batch_size]
                    images = sample_images(policy, chunk, rows, cfg, use_reference=spec is True)
                    prompts, metadata = [rows[p]["prompt"] for p, _ in chunk], [rows[p] for p, _ in chunk]
                    scored = score_batch(rewards, images, prompts, metadata)
                    for i, (p, s) in enumerate(chunk):
                        buffer[p].append(save_sample(images, scored, i, label, slugs[label], rows, p, s, cfg,
                                                      out_dir))
                        if len(buffer[p]) == len(seeds):
                            f.write("".join(json.dumps(r) + "\n" for r in buffer[p]))
                            f.flush()
                            samples += buffer.pop(p)
                            bar.update(1)
            warnings.flush(f"eval {label}")
        bar.close()

    # statistics, grids and tables from the samples (finished in this run or an earlier one)
    return write_metrics(samples, rows, variants, rewards, cfg, out_dir, slugs, log, context,
                          sampler_description(policy, cfg))
