"""DDSPO's offline pairs: x^w from the prompt c and x^l from a degraded prompt c⁻, same seed, frozen model.

Kim et al., *Direct Diffusion Score Preference Optimization*, [arXiv:2512.23426](https://arxiv.org/abs/2512.23426);
docs/methods/algorithms.md#ddspo-data. No reward model and no human label: for each prompt, one of its degraded
variants (`diffalign.data.degrade`) is drawn, and the frozen reference pipeline generates ``x^w_0`` from c and
``x^l_0`` from c⁻ with the same seed (the same initial noise and, for stochastic schedulers, the same step noise). The
latents are stored as they leave the denoiser (``output_type="latent"``: for SD the VAE latents times
``scaling_factor``, the space `policy.encode_images` returns), so training never runs the VAE.

Layout of a pairs folder (written by `generate_pairs`, the ``diffalign-ddspo-pairs`` command, or `DDSPOPairs` with
``generate: true``)::

    manifest.json             # generation settings; a folder is only ever continued with the same settings
    shard-00000.safetensors   # "latents_w", "latents_l": float32 (N, C, h, w)
    shard-00000.jsonl         # N rows {"id", "prompt", "degraded_prompt", "degraded_prompts", "seed", "metadata"}
    ...

A shard is finished when its jsonl exists (written after its safetensors, each through a temporary file and a
rename), so an interrupted generation resumes at the first unfinished shard and skips the others.

Paper defaults (authors' ``prepare_latents.py``/``scripts``, docs/methods/algorithms.md#ddspo-data, step 3): 25 steps,
CFG 7.5, the pipeline's own scheduler (PNDM for ``CompVis/stable-diffusion-v1-4``; Euler discrete for SDXL), fp16, one
degraded variant per prompt drawn uniformly from up to 5. The tiny-world recipe uses the tiny world's sampler instead
(DDIM, 20 steps, CFG 4).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING, OmegaConf
from safetensors import safe_open
from tqdm.auto import tqdm

from diffalign.config.schemas import config_schema
from diffalign.data.degrade import DEGRADATIONS, degrade_prompt, load_rewriter
from diffalign.runtime.console import quiet_on_broken_pipe
from diffalign.runtime.files import save_safetensors
from diffalign.world.prompts import load_prompts

logger = logging.getLogger(__name__)

SCHEDULERS = {
    "default": None,  # the pipeline's own scheduler
    "ddim": "DDIMScheduler",
    "pndm": "PNDMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_ancestral": "EulerAncestralDiscreteScheduler",
    "dpmsolver": "DPMSolverMultistepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
}
MANIFEST = "manifest.json"


def _seed_of(seed: int, *parts: Any) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def plan_pairs(
    rows: list[dict],
    degradation: str = "random_removal",
    num_variants: int = 5,
    samples_per_prompt: int = 1,
    seed: int = 0,
    rewriter=None,
) -> tuple[list[dict], list[str]]:
    """The pairs to generate, in order, before any image is made (deterministic in the arguments).

    For prompt ``i`` (row order) and sample ``j < samples_per_prompt``: the degraded variants of the prompt
    (`degrade_prompt` with `seed`), one of them drawn uniformly, and the image seed, both from SHA-256 of
    ``(seed, i, j)``. Prompts the degradation cannot degrade (e.g. one word under random removal) are left out.

    Returns:
        `(jobs, skipped)`: jobs are dicts ``{"id", "prompt", "degraded_prompt", "degraded_prompts", "seed",
        "metadata"}`` with consecutive ids; `skipped` the prompts left out.
    """
    jobs, skipped = [], []
    for i, row in enumerate(rows):
        try:
            variants = degrade_prompt(row["prompt"], degradation, seed=seed, num_variants=num_variants,
                                      rewriter=rewriter)
        except ValueError as err:
            logger.warning("skipping prompt %d: %s", i, err)
            skipped.append(row["prompt"])
            continue
        for j in range(samples_per_prompt):
            pick = np.random.default_rng(_seed_of(seed, "variant", i, j)).integers(len(variants))
            metadata = {k: v for k, v in row.items() if k != "prompt"}
            jobs.append({"id": len(jobs), "prompt": row["prompt"], "degraded_prompt": variants[int(pick)],
                         "degraded_prompts": variants, "seed": _seed_of(seed, "image", i, j), "metadata": metadata})
    return jobs, skipped


def set_scheduler(pipeline, scheduler: str) -> None:
    """Replaces ``pipeline.scheduler`` by a fresh scheduler of the named kind built from its config (see
    `SCHEDULERS`); "default" builds a fresh copy of the pipeline's own class, so the caller's scheduler object is never
    stepped.

    Raises:
        ValueError: for an unknown name.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler={scheduler!r} must be one of {list(SCHEDULERS)}.")
    import diffusers

    cls = type(pipeline.scheduler) if SCHEDULERS[scheduler] is None else getattr(diffusers, SCHEDULERS[scheduler])
    pipeline.scheduler = cls.from_config(pipeline.scheduler.config)


def _atomic_write(path: Path, write) -> None:
    """`write(tmp)` into a temporary file of this process alone, fsync, then rename it to `path`. Several processes
    (the ranks of a launch, or runs sharing ``data.pairs_dir``) may write the same shard at once: each writes its
    own temporary file and the renames are atomic, so `path` is always one whole copy."""
    tmp = path.with_name(f".tmp-{path.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_stale_temporaries(out: Path) -> None:
    """Removes the temporary files that processes of this host killed while writing a shard left in `out` (a live
    process's are kept; files of other hosts are left alone)."""
    import re

    from diffalign.runtime.runlock import process_alive

    mine = re.compile(rf"^\.tmp-.+-{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]{{8}}$")
    for leftover in out.glob(".tmp-*"):
        match = mine.match(leftover.name)
        if match and not process_alive(int(match.group(1))):
            leftover.unlink(missing_ok=True)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


@torch.no_grad()
def generate_pairs(
    pipeline,
    rows: list[dict],
    out_dir: str | os.PathLike,
    *,
    degradation: str = "random_removal",
    num_variants: int = 5,
    samples_per_prompt: int = 1,
    num_inference_steps: int = 25,
    guidance_scale: float = 7.5,
    scheduler: str = "default",
    seed: int = 0,
    shard_size: int = 256,
    batch_size: int = 16,
    rewriter: str | None = None,
    source: str = "",
    progress: bool = True,
    after_shard=None,
) -> dict:
    """Generates (or finishes) a DDSPO pairs folder with a frozen diffusers text-to-image pipeline (module docstring).

    Every pair runs the pipeline twice with the same per-image `torch.Generator` seed (CPU generators, so the noise is
    the same on any device): on ``[c]`` for x^w and on ``[c⁻]`` for x^l, with `guidance_scale` (CFG against the empty
    prompt) and `num_inference_steps`, ``output_type="latent"``.

    Args:
        pipeline: a diffusers pipeline (e.g. `StableDiffusionPipeline`, `StableDiffusion3Pipeline`) whose weights are
            the reference model; its scheduler is replaced as `scheduler` says.
        rows (`list[dict]`): prompt rows with a ``"prompt"`` (GenEval rows keep their other fields as metadata).
        out_dir: the pairs folder (created if missing).
        degradation, num_variants, samples_per_prompt, seed, rewriter: see `plan_pairs`; `rewriter` is an import
            string (`diffalign.data.degrade.load_rewriter`) for ``degradation="external"``.
        num_inference_steps (`int`, defaults to 25), guidance_scale (`float`, defaults to 7.5): the paper's values.
        scheduler (`str`, defaults to "default"): a key of `SCHEDULERS`.
        shard_size (`int`, defaults to 256): pairs per shard (the unit of resumption), ≥ 1.
        batch_size (`int`, defaults to 16): prompts per pipeline call, ≥ 1.
        source (`str`): a description of the model (path or hub id), recorded in the manifest.
        progress (`bool`, defaults to True): show a tqdm bar over pairs.
        after_shard (*optional*): called as ``after_shard(done, total, out_dir)`` after every shard generated here
            (the training loop's stop check: it may raise to stop between two shards).

    Returns:
        `dict`: ``{"num_pairs", "num_shards", "generated_shards", "skipped_prompts"}``.

    Raises:
        ValueError: for bad sizes or names, or when `out_dir` holds a manifest written with other settings (all but
            `source`, which only warns: a local model path changes when the checkout moves).
    """
    if shard_size < 1 or batch_size < 1 or samples_per_prompt < 1 or num_inference_steps < 1:
        raise ValueError("shard_size, batch_size, samples_per_prompt and num_inference_steps must all be >= 1.")
    if degradation not in DEGRADATIONS:
        raise ValueError(f"degradation={degradation!r} must be one of {list(DEGRADATIONS)}.")
    out = Path(out_dir)
    settings = {"source": source, "prompts": [r["prompt"] for r in rows], "degradation": degradation,
                "num_variants": num_variants, "samples_per_prompt": samples_per_prompt,
                "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale, "scheduler": scheduler,
                "seed": seed, "shard_size": shard_size, "rewriter": rewriter}
    manifest_path = out / MANIFEST
    if manifest_path.is_file():
        old = json.loads(manifest_path.read_text())["settings"]
        changed = sorted(k for k in settings if k != "source" and old.get(k) != settings[k])
        if old.get("source") != source:  # a path moves with the checkout; only warn
            logger.warning("%s was generated from %r, this run's model is %r", out, old.get("source"), source)
        if changed:
            raise ValueError(f"{out} holds pairs generated with other settings ({', '.join(changed)} differ); "
                             "continue with the same settings or choose another folder.")
    jobs, skipped = plan_pairs(rows, degradation, num_variants, samples_per_prompt, seed,
                               load_rewriter(rewriter) if rewriter else None)
    if not jobs:
        raise ValueError("no prompt could be degraded; nothing to generate.")
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    num_shards = -(-len(jobs) // shard_size)
    _atomic_write(manifest_path, lambda p: p.write_text(json.dumps(
        {"settings": settings, "num_pairs": len(jobs), "num_shards": num_shards, "skipped_prompts": skipped},
        indent=1)))

    set_scheduler(pipeline, scheduler)
    pipeline.set_progress_bar_config(disable=True)
    todo = [k for k in range(num_shards) if not (out / f"{shard_name(k)}.jsonl").is_file()]
    done_pairs = len(jobs) - sum(len(jobs[k * shard_size:(k + 1) * shard_size]) for k in todo)
    bar = tqdm(total=len(jobs), initial=done_pairs, desc="ddspo pairs", unit="pair", disable=not progress)
    for k in todo:
        shard = jobs[k * shard_size:(k + 1) * shard_size]
        latents = {"latents_w": [], "latents_l": []}
        for start in range(0, len(shard), batch_size):
            chunk = shard[start:start + batch_size]
            for key, field in (("latents_w", "prompt"), ("latents_l", "degraded_prompt")):
                generators = [torch.Generator(device="cpu").manual_seed(job["seed"]) for job in chunk]
                result = pipeline(prompt=[job[field] for job in chunk], num_inference_steps=num_inference_steps,
                                  guidance_scale=guidance_scale, generator=generators, output_type="latent")
                latents[key].append(result.images.float().cpu())
            bar.update(len(chunk))
        tensors = {key: torch.cat(value).contiguous() for key, value in latents.items()}
        rows = "".join(json.dumps(job) + "\n" for job in shard)
        _atomic_write(out / f"{shard_name(k)}.safetensors", lambda p, t=tensors: save_safetensors(t, p))
        _atomic_write(out / f"{shard_name(k)}.jsonl", lambda p, r=rows: p.write_text(r))
        if after_shard is not None:
            try:
                after_shard(num_shards - len(todo) + todo.index(k) + 1, num_shards, out)
            except BaseException:
                bar.close()
                raise
    bar.close()
    return {"num_pairs": len(jobs), "num_shards": num_shards, "generated_shards": len(todo),
            "skipped_prompts": len(skipped)}


# ------------------------------------------------------------------------------------------------------ the data set


@config_schema("data", "ddspo_pairs")
@dataclass
class DDSPOPairsConfig:
    """Config of `DDSPOPairs` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.data.ddspo_pairs.DDSPOPairs"
    pairs_dir: str = MISSING
    generate: bool = False  # make the missing shards first; the settings below are the generation's
    prompts: str = "train"  # shipped split or a jsonl/txt prompt file
    degradation: str = "random_removal"  # random_removal (paper, 40-70% of words) | attributes | external
    num_variants: int = 5  # degraded variants per prompt, one per pair [CODE random_removal.py]
    samples_per_prompt: int = 1
    num_inference_steps: int = 25  # [CODE prepare_latents.py default]
    guidance_scale: float = 7.5  # [CODE scripts/prepare_latents.sh]
    scheduler: str = "default"  # default (the policy's) | ddim | pndm | euler | euler_ancestral | ...
    seed: int = 0
    shard_size: int = 256
    batch_size: int = 16
    rewriter: str | None = None  # 'package.module:factory' returning a PromptRewriter
    source: str = ""  # recorded in the manifest
    max_pairs: int | None = None


class DDSPOPairs:
    """A DDSPO pairs folder as preference data: winners x^w from c, losers x^l from c⁻, as latents.

    With ``generate=False`` the folder must be complete (made by ``diffalign-ddspo-pairs``). With ``generate=True``,
    `prepare(policy, rewards)` (called by the training loop before training) first generates the missing shards with
    the policy's frozen reference (``policy.reference()``, ``policy.to_pipeline()``) and the generation arguments,
    exactly as `generate_pairs` does; "default" then means the policy's DDIM scheduler.

    Args:
        pairs_dir (`str`): the folder.
        generate (`bool`, defaults to False): generate missing shards in `prepare`.
        prompts, degradation, num_variants, samples_per_prompt, num_inference_steps, guidance_scale, scheduler, seed,
            shard_size, batch_size, rewriter, source: generation settings (`generate_pairs`; `prompts` is a shipped
            split or a prompt file), used only with ``generate=True``.
        max_pairs (`int`, *optional*): use only the first `max_pairs` pairs.

    ``collate(indices)`` returns ``{"ids" (B,), "prompts", "degraded_prompts", "metadata", "latents_w" (B,C,h,w),
    "latents_l" (B,C,h,w)}`` (float32); the preference loop encodes the degraded prompts too and fills
    `PreferenceBatch.degraded_prompts` / ``degraded_prompt_embeds``.

    Raises:
        FileNotFoundError: (without `generate`) if the folder or a shard is missing, naming ``data.pairs_dir``.
        ValueError: if `max_pairs` < 1.
    """

    degraded_prompts = True  # batches carry the degraded prompts c⁻ (DDSPO's TF-CPP, `diffalign.objectives.ddspo`)

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): the prompt file, and a pairs
        folder that is given and holds pairs unless ``data.generate`` makes them.

        Raises:
            ValueError, FileNotFoundError: naming ``data.prompts`` or ``data.pairs_dir`` and the fix.
        """
        from diffalign.config.checks import choice, integer, number, seed

        d = cfg.data
        for key in ("num_variants", "samples_per_prompt", "num_inference_steps", "shard_size", "batch_size"):
            integer(d, key, "data", ge=1)
        integer(d, "max_pairs", "data", ge=1, nullable=True)
        number(d, "guidance_scale", "data", ge=1, hint="classifier-free guidance w >= 1; 1 turns guidance off")
        choice(d, "scheduler", "data", list(SCHEDULERS))
        choice(d, "degradation", "data", list(DEGRADATIONS))
        seed(d, "seed", "data")
        load_prompts(cfg.data.prompts, field="data.prompts")
        if OmegaConf.is_missing(cfg.data, "pairs_dir"):
            raise ValueError("data.pairs_dir is required for data=ddspo_pairs; pass data.pairs_dir=<folder> (made by "
                             "diffalign-ddspo-pairs, or set data.generate=true to make it)")
        if not cfg.data.generate and not (Path(cfg.data.pairs_dir) / "manifest.json").is_file():
            raise FileNotFoundError(f"data.pairs_dir={cfg.data.pairs_dir!r} holds no DDSPO pairs (manifest.json); make "
                                    "them with diffalign-ddspo-pairs --out <folder>, or set data.generate=true")


    def __init__(self, pairs_dir: str, generate: bool = False, prompts: str = "train",
                 degradation: str = "random_removal", num_variants: int = 5, samples_per_prompt: int = 1,
                 num_inference_steps: int = 25, guidance_scale: float = 7.5, scheduler: str = "default", seed: int = 0,
                 shard_size: int = 256, batch_size: int = 16, rewriter: str | None = None, source: str = "",
                 max_pairs: int | None = None):
        if max_pairs is not None and max_pairs < 1:
            raise ValueError(f"data.max_pairs must be >= 1 or null, got {max_pairs}")
        self.pairs_dir, self.generate, self.max_pairs = Path(pairs_dir), generate, max_pairs
        self.prompts = prompts
        self.settings = {"degradation": degradation, "num_variants": num_variants,
                         "samples_per_prompt": samples_per_prompt, "num_inference_steps": num_inference_steps,
                         "guidance_scale": guidance_scale, "scheduler": scheduler, "seed": seed,
                         "shard_size": shard_size, "batch_size": batch_size, "rewriter": rewriter, "source": source}
        self.items: list[tuple[str, int, dict]] | None = None
        self.stats: dict = {}
        if not generate:
            self._load_index()

    def prepare(self, policy, rewards: dict, preparation=None) -> None:
        """Generates the missing shards (``generate=True``) with the policy's frozen reference; then reads the index.
        With the training loop's `preparation` a stop signal ends the generation after the current shard (one
        process; with several, at the first training step)."""
        if self.generate:
            after_shard = preparation.after_chunk if preparation is not None and preparation.single_process else None
            with policy.reference():
                self.stats = generate_pairs(policy.to_pipeline(), load_prompts(self.prompts), self.pairs_dir,
                                            **self.settings, after_shard=after_shard)
        self._load_index()

    def _load_index(self) -> None:
        manifest = self.pairs_dir / MANIFEST
        if not manifest.is_file():
            raise FileNotFoundError(f"data.pairs_dir={str(self.pairs_dir)!r} holds no {MANIFEST}; generate the pairs "
                                    "with `diffalign-ddspo-pairs` or set data.generate=true")
        num_shards = json.loads(manifest.read_text())["num_shards"]
        items = []
        for k in range(num_shards):
            rows_file = self.pairs_dir / f"{shard_name(k)}.jsonl"
            if not rows_file.is_file():
                raise FileNotFoundError(f"data.pairs_dir={str(self.pairs_dir)!r}: {rows_file.name} is missing (an "
                                        "unfinished generation); rerun `diffalign-ddspo-pairs` with the same "
                                        "arguments to finish it")
            tensors = str(self.pairs_dir / f"{shard_name(k)}.safetensors")
            rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
            items += [(tensors, r, row) for r, row in enumerate(rows)]
        self.items = items[:self.max_pairs] if self.max_pairs is not None else items
        self.stats.setdefault("num_pairs", len(self.items))

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> dict:
        """Stacks pairs `indices` (see the class docstring), reading only their rows from the shards."""
        picked = [self.items[i] for i in indices]
        latents = {"latents_w": [None] * len(picked), "latents_l": [None] * len(picked)}
        for path in dict.fromkeys(p for p, _, _ in picked):
            with safe_open(path, framework="pt") as f:
                for key, rows in latents.items():
                    view = f.get_slice(key)
                    for n, (p, r, _) in enumerate(picked):
                        if p == path:
                            rows[n] = view[r:r + 1][0]
        return {"ids": torch.tensor([row["id"] for _, _, row in picked], dtype=torch.long),
                "prompts": [row["prompt"] for _, _, row in picked],
                "degraded_prompts": [row["degraded_prompt"] for _, _, row in picked],
                "metadata": [row["metadata"] for _, _, row in picked],
                **{key: torch.stack(value).float() for key, value in latents.items()}}


# ----------------------------------------------------------------------------------------------------------- command


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> None:
    """``diffalign-ddspo-pairs``: generates a DDSPO pairs folder with a diffusers pipeline (see the module docstring).

    Example (the paper's SD1.4 alignment data, on a GPU)::

        diffalign-ddspo-pairs --model CompVis/stable-diffusion-v1-4 --prompts diffusiondb_prompts.txt \\
            --out data/ddspo_sd14 --torch-dtype float16
    """
    from diffalign.config.compose import asset_path

    parser = argparse.ArgumentParser(prog="diffalign-ddspo-pairs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="diffusers folder or hub id (default: the tiny world's tiny_sd)")
    parser.add_argument("--out", required=True, help="pairs folder; rerun with the same arguments to resume")
    parser.add_argument("--prompts", default="train", help="'train'/'heldout' (tiny world) or a .jsonl/.txt file")
    parser.add_argument("--max-prompts", type=int, default=None, help="only the first N prompts")
    parser.add_argument("--degradation", default="random_removal", choices=DEGRADATIONS)
    parser.add_argument("--rewriter", default=None, help="'package.module:factory' for --degradation external")
    parser.add_argument("--num-variants", type=int, default=5, help="degraded variants per prompt (paper: 5)")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="pairs per prompt (paper: 1)")
    parser.add_argument("--num-inference-steps", type=int, default=25, help="paper: 25")
    parser.add_argument("--guidance-scale", type=float, default=7.5, help="paper: 7.5")
    parser.add_argument("--scheduler", default="default", choices=list(SCHEDULERS),
                        help="default: the pipeline's own (paper: SD1.x default, SDXL euler)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--torch-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from diffusers import DiffusionPipeline

    rows = load_prompts(args.prompts, field="--prompts")[:args.max_prompts]
    model = args.model or asset_path("tiny_sd")
    local_only = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    pipeline = DiffusionPipeline.from_pretrained(model, dtype=getattr(torch, args.torch_dtype),
                                                 safety_checker=None, local_files_only=local_only).to(args.device)
    stats = generate_pairs(pipeline, rows, args.out, degradation=args.degradation, num_variants=args.num_variants,
                           samples_per_prompt=args.samples_per_prompt, num_inference_steps=args.num_inference_steps,
                           guidance_scale=args.guidance_scale, scheduler=args.scheduler, seed=args.seed,
                           shard_size=args.shard_size, batch_size=args.batch_size, rewriter=args.rewriter,
                           source=model)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
