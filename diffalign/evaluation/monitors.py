"""Reward-hacking monitors, logged during training every ``monitor.every`` optimizer steps.

A policy that hacks its training reward raises that reward while something else degrades. Two signals make that
visible in the logs before it ruins a run (docs/guides/rewards.md#reward-hacking-monitors):

- **gold reward**: held-out rewards (by default the evaluation reward set, ``eval_reward=[...]`` or else
  ``reward=[...]``) on fixed prompts and fixed per-image seeds, with a deterministic sampler (``monitor.sampler``,
  by default ``sampler=ode``: DDIM with η = 0 for ε/v models, the Euler ODE for flow models), so two log points
  differ only by the policy. A training reward that climbs while the gold reward falls is the classic sign.
- **group diversity**: for each prompt, the mean pairwise cosine distance ``1 − cos(e_i, e_j)`` of the CLIP image
  embeddings of its images under the different seeds, averaged over prompts. Mode collapse (every seed giving the
  same image) drives it towards 0.

Logged keys (``accelerator.log``): ``monitor/gold/<reward>/mean`` (and ``monitor/gold/<reward>/accuracy`` for
rewards that report GenEval correctness), ``monitor/diversity``. With ``save_samples`` the first seed's sample of
every monitor prompt is also written at each measurement, so the logs show what the numbers measure:
``<output_dir>/logs/samples/step-<N>/<prompt index>.png`` for images, one ``.gif`` / ``.mp4`` of all F frames per
video (``video_format``). For videos the diversity embeds every frame and averages the embeddings over frames. Rewards are called through
`diffalign.rewards.reward_set.score_or_raise`, so a NaN gold score stops the run like any other reward failure.

Config (``monitor:`` in ``configs/train.yaml``)::

    monitor:
      every: 0                 # optimizer steps between measurements; 0 turns the monitors off
      prompts: heldout         # a shipped split or a GenEval jsonl / txt file
      num_prompts: 8           # evenly spaced through the file
      seeds: [0, 1, 2, 3]      # per-image seeds; the group of each prompt (>= 2 for diversity)
      rewards: null            # names from the evaluation reward set; null = all of them
      diversity: true
      diversity_model: diffalign-tiny-clip   # open_clip model for the embeddings (see reward clip_score)
      diversity_pretrained: null
      sampler: ...             # a sampler node (train.yaml's defaults list: sampler@monitor.sampler=ode)
      batch_size: 64
      save_samples: true       # one sample per prompt to logs/samples/step-<N>/ (PNG; GIF/MP4 for videos)
      video_format: gif
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from diffalign.config.checks import check_node_keys, node_check
from diffalign.rewards.base import Reward
from diffalign.rewards.reward_set import score_or_raise
from diffalign.samplers.base import Sampler, build_sampler


@dataclass
class MonitorConfig:
    """The ``monitor:`` config node; see the module docstring for the meaning of each field."""

    every: int = 0
    prompts: str = "heldout"
    num_prompts: int = 8
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    rewards: list[str] | None = None
    diversity: bool = True
    diversity_model: str = "diffalign-tiny-clip"
    diversity_pretrained: str | None = None
    sampler: Any = None
    batch_size: int = 64
    save_samples: bool = True
    video_format: str = "gif"


@node_check("monitor_keys")
def check_monitor_keys(node) -> None:
    """The ``monitor`` node has only `MonitorConfig`'s fields: ``+monitor.evry=1`` is refused naming ``monitor.every``
    before any model loads (`diffalign.config.checks.check_node_keys`), not met after the model is loaded."""
    check_node_keys(node, "monitor", MonitorConfig)


def pairwise_diversity(embeddings: torch.Tensor) -> torch.Tensor:
    r"""Mean pairwise cosine distance $\frac{2}{G(G-1)} \sum_{i<j} (1 - \cos(e_i, e_j))$ of a group.

    Args:
        embeddings (`torch.Tensor`): `(G, D)` embeddings of one group, G ≥ 2 (need not be normalised).

    Returns:
        `torch.Tensor`: a float32 scalar in [0, 2]; 0 when every embedding points the same way.

    Raises:
        ValueError: if G < 2.
    """
    g = embeddings.shape[0]
    if embeddings.ndim != 2 or g < 2:
        raise ValueError(f"diversity needs a (G, D) group with G >= 2, got shape {tuple(embeddings.shape)}")
    unit = F.normalize(embeddings.float(), dim=-1)
    cosine = unit @ unit.T
    upper = torch.triu_indices(g, g, offset=1)
    return (1.0 - cosine[upper[0], upper[1]]).mean()


class HackingMonitor:
    """Gold rewards on fixed prompts and seeds, and group diversity, for one policy at a time.

    Args:
        rewards (`Mapping[str, Reward]`): the gold rewards by name (held out from training).
        rows (`list[dict]`): prompt rows (``{"prompt", ...}`` with optional GenEval metadata), fixed for the run.
        seeds (`list[int]`): per-image seeds; image (seed s, prompt p) uses ``torch.Generator().manual_seed(s *
            1_000_003 + p)``, as evaluation does.
        every (`int`): optimizer steps between measurements (`maybe_log` measures when ``step % every == 0``); ≥ 1.
        embedder (*optional*): an object with ``embed_images(images (N, 3, H, W) in [0, 1]) -> (N, D)`` (e.g.
            `diffalign.rewards.clip_score.ClipScore`); `None` skips diversity.
        sampler (`Sampler` or a ``sampler`` config node, *optional*): the sampler of the monitor images
            (``monitor.sampler``); None: ``sampler=ode``'s defaults (DDIM with η = 0 for ε/v models, the Euler ODE
            for flow models, 20 steps, CFG 4.0).
        batch_size (`int`, defaults to 64): images per sampling batch.

    Raises:
        ValueError: `every` < 1, no rows, no seeds, or an embedder with fewer than 2 seeds; a bad `sampler`
            (`ConfigError` naming ``monitor.sampler.<field>``).
    """

    def __init__(self, rewards: Mapping[str, Reward], rows: list[dict], seeds: list[int], *, every: int,
                 embedder: Any | None = None, sampler: Sampler | Any = None, batch_size: int = 64,
                 samples_dir: str | Path | None = None, video_format: str = "gif"):
        if every < 1:
            raise ValueError(f"monitor.every must be >= 1 (0 turns the monitors off), got {every}")
        if not rows or not seeds:
            raise ValueError("monitor.prompts and monitor.seeds must select at least one prompt and one seed")
        if embedder is not None and len(seeds) < 2:
            raise ValueError(f"monitor.seeds={list(seeds)}: diversity needs >= 2 seeds per prompt (or "
                             "monitor.diversity=false)")
        self.rewards, self.rows, self.seeds, self.every = dict(rewards), list(rows), list(seeds), every
        if video_format not in ("gif", "mp4"):
            raise ValueError(f"monitor.video_format must be gif or mp4, got {video_format!r}")
        self.embedder, self.batch_size = embedder, batch_size
        self.samples_dir, self.video_format = (Path(samples_dir) if samples_dir is not None else None), video_format
        self.sampler = build_sampler({"name": "ode"} if sampler is None else sampler, "monitor.sampler")
        self.history: list[dict[str, float]] = []

    @torch.no_grad()
    def measure(self, policy, step: int | None = None) -> dict[str, float]:
        """Samples every (seed, prompt) with `policy` (eval mode, restored afterwards) and returns the metrics.

        Raises:
            RewardError: a gold reward raised or returned NaN/inf (named, with the step and the batch).
        """
        from diffalign.samplers.rollout import rollout

        jobs = [(s, p) for p in range(len(self.rows)) for s in self.seeds]  # grouped by prompt
        was_training = policy.denoiser.training
        policy.denoiser.eval()
        images = []
        try:
            for start in range(0, len(jobs), self.batch_size):
                chunk = jobs[start:start + self.batch_size]
                gens = [torch.Generator().manual_seed(s * 1_000_003 + p) for s, p in chunk]
                traj = rollout(policy, [self.rows[p]["prompt"] for _, p in chunk],
                               self.sampler, generator=gens, fuse_lora=True)
                images.append(traj.images.float().cpu())
        finally:
            policy.denoiser.train(was_training)
        images = torch.cat(images)
        prompts = [self.rows[p]["prompt"] for _, p in jobs]
        metadata = [self.rows[p] for _, p in jobs]
        metrics: dict[str, float] = {}
        outputs = score_or_raise(self.rewards, images, prompts, metadata, step=step, batch_index=len(self.history))
        for name, out in outputs.items():
            metrics[f"monitor/gold/{name}/mean"] = float(out.scores.mean())
            if "correct" in out.info:
                metrics[f"monitor/gold/{name}/accuracy"] = float(torch.as_tensor(out.info["correct"]).float().mean())
        if self.samples_dir is not None and step is not None:
            self.save_samples(images, step)
        if self.embedder is not None:
            g = len(self.seeds)
            if images.ndim == 5:  # videos (N, F, C, H, W): the mean embedding of the frames
                n, f = images.shape[:2]
                embeddings = self.embedder.embed_images(images.flatten(0, 1)).float().view(n, f, -1).mean(1)
                embeddings = embeddings.view(len(self.rows), g, -1)
            else:
                embeddings = self.embedder.embed_images(images).float().view(len(self.rows), g, -1)
            metrics["monitor/diversity"] = float(torch.stack([pairwise_diversity(e) for e in embeddings]).mean())
        return metrics

    def log_samples(self, accelerator, folder: Path, step: int) -> None:
        """Logs the samples `save_samples` wrote into `folder` to the run's TensorBoard / wandb tracker at `step`:
        ``monitor/samples``, one image or video per monitor prompt, captioned with its prompt."""
        from diffalign.runtime.trackers import log_images, log_videos

        files = sorted(folder.glob(f"*.{self.video_format}")) or sorted(folder.glob("*.png"))
        captions = {"monitor/samples": [self.rows[int(f.stem)]["prompt"] for f in files]}
        if files and files[0].suffix == ".png":
            log_images(accelerator, {"monitor/samples": files}, step, captions)
        else:
            log_videos(accelerator, {"monitor/samples": files}, step, captions=captions)

    def save_samples(self, images: torch.Tensor, step: int) -> Path:
        """Writes the first seed's sample of each prompt to ``<samples_dir>/step-<step>/<prompt index>.png`` (images
        `(N, C, H, W)`) or ``.gif`` / ``.mp4`` (videos `(N, F, C, H, W)`, all F frames), plus ``prompts.txt``;
        returns the folder. `images` are grouped by prompt, ``len(seeds)`` per prompt, in [0, 1]."""
        from diffalign.runtime.media import save_png, save_video

        out = self.samples_dir / f"step-{step}"
        out.mkdir(parents=True, exist_ok=True)
        g = len(self.seeds)
        for p, row in enumerate(self.rows):
            sample = images[p * g]
            if sample.ndim == 4:
                save_video(sample, out / f"{p:03d}.{self.video_format}")
            else:
                save_png(sample, out / f"{p:03d}.png")
        (out / "prompts.txt").write_text("".join(f"{p:03d}\t{row['prompt']}\n" for p, row in enumerate(self.rows)),
                                         encoding="utf-8")
        return out

    def maybe_log(self, step: int, policy, accelerator=None, log: Callable[[str], None] | None = None,
                  tracker_step: int | None = None) -> dict[str, float] | None:
        """Measures and logs when ``step % every == 0``; returns the metrics (else `None`).

        Args:
            step (`int`): the global optimizer step (0 = before training).
            policy: the policy being trained.
            accelerator (`accelerate.Accelerator`, *optional*): metrics go to ``accelerator.log(metrics, step=...)``,
                and the saved samples (``monitor.save_samples``) to its TensorBoard / wandb tracker as
                ``monitor/samples`` (images, or videos for a video model; `diffalign.runtime.trackers`).
            log (`Callable[[str], None]`, *optional*): also prints a one-line summary.
            tracker_step (`int`, *optional*): the trackers' step when it is not `step` (the online loop logs per
                epoch).
        """
        if step % self.every != 0:
            return None
        metrics = self.measure(policy, step=step)
        self.history.append({"step": step, **metrics})
        if accelerator is not None:
            at = step if tracker_step is None else tracker_step
            accelerator.log(metrics, step=at)
            if self.samples_dir is not None:
                self.log_samples(accelerator, self.samples_dir / f"step-{step}", at)
        if log is not None:
            log(f"[diffalign] monitor step {step}: " + ", ".join(f"{k[len('monitor/'):]}={v:.4f}"
                                                                 for k, v in metrics.items()))
        return metrics


def build_monitor(node: Mapping[str, Any] | None, eval_rewards: Mapping[str, Reward],
                  samples_dir: str | Path | None = None) -> HackingMonitor | None:
    """The `HackingMonitor` of a ``monitor:`` config node, or `None` when it is absent or ``every`` is 0.

    Args:
        node: the ``monitor`` config node (fields of `MonitorConfig`; missing fields take its defaults).
        eval_rewards (`Mapping[str, Reward]`): the evaluation reward set; ``monitor.rewards`` picks names from it.
        samples_dir (*optional*): where ``save_samples`` writes (the loops pass ``<output_dir>/logs/samples``).

    Raises:
        ValueError: an unknown field, a reward name not in `eval_rewards`, or the checks of `HackingMonitor`.
    """
    from omegaconf import OmegaConf

    if node is None:
        return None
    cfg = MonitorConfig(**(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)))
    if cfg.every == 0:
        return None
    from diffalign.world.prompts import load_prompts

    names = list(eval_rewards) if cfg.rewards is None else list(cfg.rewards)
    unknown = [n for n in names if n not in eval_rewards]
    if unknown:
        raise ValueError(f"monitor.rewards={names}: {unknown} not in the evaluation reward set {sorted(eval_rewards)}; "
                         "select them with eval_reward=[...] (or reward=[...])")
    rows = load_prompts(cfg.prompts, field="monitor.prompts")
    if cfg.num_prompts < 1:
        raise ValueError(f"monitor.num_prompts must be >= 1, got {cfg.num_prompts}")
    n = min(cfg.num_prompts, len(rows))
    rows = [rows[(i * len(rows)) // n] for i in range(n)]
    embedder = None
    if cfg.diversity:
        from diffalign.rewards.clip_score import ClipScore

        embedder = ClipScore(model_name=cfg.diversity_model, pretrained=cfg.diversity_pretrained)
    return HackingMonitor({n: eval_rewards[n] for n in names}, rows, cfg.seeds, every=cfg.every, embedder=embedder,
                          sampler=cfg.sampler, batch_size=cfg.batch_size,
                          samples_dir=samples_dir if cfg.save_samples else None, video_format=cfg.video_format)
