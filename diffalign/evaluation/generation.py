"""Evaluation settings and generation: the ``eval`` node (`EvalConfig`), the prompt selection and the images of every
(prompt, seed), each from its own generator.

The image for prompt ``p`` (its index in the prompt list) and seed ``s`` is generated with its own
``torch.Generator().manual_seed(image_seed(s, p))``, so the base model and every checkpoint see the same initial
noise, and any single image can be re-made alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from diffalign.config.schemas import config_schema
from diffalign.samplers.base import Sampler, build_sampler
from diffalign.samplers.rollout import rollout


@dataclass
class EvalConfig:
    """Evaluation settings (``eval`` in the Hydra config).

    Attributes:
        prompts: a shipped split (``"heldout"``, ``"train"``) or a path to a prompt file: GenEval metadata / plain
            jsonl, DrawBench / PartiPrompts-style csv or tsv, or plain txt (`diffalign.world.prompts.load_prompts`).
        prompts_per_tag: at most this many prompts per GenEval tag (all when None), chosen evenly through the file.
        seeds: seeds per prompt; the image seed is ``image_seed(seed, prompt_index)``.
        sampler: the sampler of every image, a `Sampler` or a ``sampler`` config node (``eval.sampler``; the
            config's default is ``sampler=ode``: DDIM with η = 0 for ε/v models, the Euler ODE for flow models, 20
            steps, CFG 4.0, as the diffusers pipelines sample; ``sampler@eval.sampler=<option>`` selects another,
            ``eval.sampler.num_inference_steps=50`` changes a field). None: ``sampler=ode``'s defaults.
        batch_size: images per sampling batch.
        grid_images: how many images go into each variant's overview grid PNG.
        bootstrap_resamples, confidence, bootstrap_seed: the prompt-level bootstrap of every interval
            (`diffalign.evaluation.stats.bootstrap_ci`).
        video_format: ``"gif"`` or ``"mp4"``, the file written per sample of a video model.
        reuse_base: take the base model's samples from an earlier evaluation beside this one (a sibling folder of
            the run folder, e.g. another ``runs/train-*/eval``) when it used the same base weights (hash of the
            frozen parameters), prompts, seeds, sampler and rewards, instead of sampling them again
            (`find_reusable_base`).
    """

    prompts: str = "heldout"
    prompts_per_tag: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    sampler: Any = None
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
    """`EvalConfig` from the Hydra ``eval`` node (its ``enabled`` switch belongs to the training loop), with its
    sampler built (`eval_sampler`).

    Raises:
        ConfigError: a bad ``eval.sampler`` node, naming ``eval.sampler.<field>``.
    """
    from omegaconf import OmegaConf

    cfg = EvalConfig(**{k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "enabled"})
    cfg.sampler = eval_sampler(cfg)
    return cfg


def eval_sampler(cfg: EvalConfig) -> Sampler:
    """The `Sampler` of ``cfg.sampler`` (``sampler=ode``'s defaults when None).

    Raises:
        ConfigError: naming ``eval.sampler.<field>``, the value and the fix.
    """
    return build_sampler({"name": "ode"} if cfg.sampler is None else cfg.sampler, "eval.sampler")


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


@torch.no_grad()
def generate(policy, rows: list[dict], seeds: list[int], cfg: EvalConfig, use_reference: bool = False):
    """Images `(N, 3, H, W)` in [0, 1] for every (seed, prompt) and their records (prompt, seed, image_seed, tag).

    With `use_reference` the policy samples under ``policy.reference()`` (the adapter-disabled base model).
    """
    jobs = [(s, p, row) for s in seeds for p, row in enumerate(rows)]
    images, records = [], []
    for start in range(0, len(jobs), cfg.batch_size):
        chunk = jobs[start:start + cfg.batch_size]
        images.append(sample_images(policy, [(p, s) for s, p, _ in chunk], rows, cfg, use_reference))
        records += [{"prompt": row["prompt"], "seed": s, "image_seed": image_seed(s, p), "prompt_index": p,
                     "tag": row.get("tag")} for s, p, row in chunk]
    return torch.cat(images), records


def sample_images(policy, jobs: list[tuple[int, int]], rows: list[dict], cfg: EvalConfig, use_reference: bool):
    """Images for the (prompt_index, seed) `jobs`, each from its own generator; float32 on the CPU."""
    gens = [torch.Generator(device="cpu").manual_seed(image_seed(s, p)) for p, s in jobs]
    prompts = [rows[p]["prompt"] for p, _ in jobs]
    sampler = eval_sampler(cfg)
    if use_reference:
        with policy.reference():
            traj = rollout(policy, prompts, sampler, generator=gens, fuse_lora=True)
    else:
        traj = rollout(policy, prompts, sampler, generator=gens, fuse_lora=True)
    return traj.images.float().cpu()


def sampler_description(policy, cfg: EvalConfig) -> str:
    """The evaluation's sampler in words, for the report's header, as it steps `policy` (`Sampler.for_policy`):
    ``"20 DDIM steps, η 0.0"``, ``"20 Euler ODE steps"`` (``flow_sde`` at noise_level 0, which ``sampler=ode`` runs on
    a flow model), ``"20 flow SDE steps (Flow-GRPO's, a = 0.7)"``, otherwise ``"<K> <option> steps"`` and its noise
    parameter (e.g. ``"10 dance_sde steps, noise_level 0.3"``)."""
    sampler = eval_sampler(cfg).for_policy(policy)
    steps = sampler.num_inference_steps
    if sampler.name == "ddim":
        return f"{steps} DDIM steps, η {sampler.eta}"
    if sampler.name == "flow_sde":
        a = sampler.noise_level
        return f"{steps} Euler ODE steps" if a == 0 else f"{steps} flow SDE steps (Flow-GRPO's, a = {a})"
    noise = f", {sampler.noise_field} {sampler.noise}" if sampler.noise_field else ""
    return f"{steps} {sampler.name} steps{noise}"
