"""Data containers that flow between diffalign's parts.

Shapes are documented per field. ``B`` is the batch, ``K`` the number of denoising steps, ``C, H, W`` the
latent channels/height/width in the model's native layout, ``L`` the text length and ``D`` the text width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptEmbeds:
    """Encoded prompts.

    Attributes:
        prompt_embeds: `(B, L, D)` conditional token embeddings.
        negative_prompt_embeds: `(B, L, D)` unconditional/negative token embeddings, or `None` when classifier-free
            guidance is off. Classifier-free guidance batches are always built in the order ``[negative, positive]``
            (``torch.cat([negative_prompt_embeds, prompt_embeds])``), the order diffusers pipelines use.
        pooled_prompt_embeds: `(B, D')` pooled embeddings for models that take them (SDXL, SD3); `None` for SD1.x/2.x.
        negative_pooled_prompt_embeds: `(B, D')` or `None`, same order rule as the token embeddings.
    """

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def index(self, idx: torch.Tensor | slice | list[int]) -> PromptEmbeds:
        """Selects rows `idx` of every tensor."""
        pick = lambda t: None if t is None else t[idx]
        return PromptEmbeds(
            pick(self.prompt_embeds),
            pick(self.negative_prompt_embeds),
            pick(self.pooled_prompt_embeds),
            pick(self.negative_pooled_prompt_embeds),
        )

    def repeat_interleave(self, n: int) -> PromptEmbeds:
        """Repeats each row `n` times: rows ``[p0, p1]`` become ``[p0]*n + [p1]*n``."""
        rep = lambda t: None if t is None else t.repeat_interleave(n, dim=0)
        return PromptEmbeds(
            rep(self.prompt_embeds),
            rep(self.negative_prompt_embeds),
            rep(self.pooled_prompt_embeds),
            rep(self.negative_pooled_prompt_embeds),
        )


@dataclass
class Trajectory:
    """One unrolled sampling run.

    Attributes:
        latents: `(B, K+1, C, H, W)`; ``latents[:, 0]`` is the initial noise, ``latents[:, k+1]`` is the sample after
            step ``k`` (so ``latents[:, k]`` is x_t and ``latents[:, k+1]`` is x_{t-1} for ``timesteps[k]``).
        timesteps: `(K,)` scheduler timesteps: int64 for DDIM (e.g. ``[981, 961, ..., 1]`` for 50 SD steps), float32
            ``1000 σ_k`` for flow models.
        log_probs: `(B, K)` float32 log-probability of each transition under the sampling policy (reduced as the
            sampler documents); 0 where ``std`` is 0 (a deterministic step).
        trainable: `(K,)` bool, False for steps whose std is 0 (no log-prob is defined there).
        prompt_embeds: the `PromptEmbeds` used, one row per sample.
        images: `(B, 3, H_px, W_px)` float32 decoded images in [0, 1], or `None` if not decoded.
        prompts: the `B` prompt strings.
        guidance_scale: the classifier-free guidance scale used in the rollout.
        noise: the value of the sampler's noise parameter (`diffalign.samplers.base.Sampler.noise`: DDIM's ``eta``,
            a flow SDE's ``noise_level``); 0 is deterministic.
        sigmas: `(K+1,)` float32 noise levels σ_k of a flow-model rollout (σ_0 = 1 … σ_K = 0); `None` for DDIM.
        sampler: the sampler option that produced it (``ddim``, ``flow_sde``, ``dance_sde``, ``cps_sde``,
            ``window_sde``, ``dpm_ode``, ``euler_ode``, or a registered one; `diffalign.samplers.base.SAMPLERS`).
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    log_probs: torch.Tensor
    trainable: torch.Tensor
    prompt_embeds: PromptEmbeds
    images: torch.Tensor | None
    prompts: list[str]
    guidance_scale: float
    noise: float
    sigmas: torch.Tensor | None = None
    sampler: str = "ddim"

    def index(self, rows: torch.Tensor | list[int]) -> Trajectory:
        """The rollouts `rows` (a minibatch), sharing the schedule."""
        rows_t = torch.as_tensor(rows, dtype=torch.long)
        return Trajectory(
            latents=self.latents[rows_t.to(self.latents.device)],
            timesteps=self.timesteps,
            log_probs=self.log_probs[rows_t.to(self.log_probs.device)],
            trainable=self.trainable,
            prompt_embeds=self.prompt_embeds.index(rows_t.to(self.prompt_embeds.prompt_embeds.device)),
            images=None if self.images is None else self.images[rows_t.to(self.images.device)],
            prompts=[self.prompts[int(i)] for i in rows_t],
            guidance_scale=self.guidance_scale,
            noise=self.noise,
            sigmas=self.sigmas,
            sampler=self.sampler,
        )

    @property
    def next_latents(self) -> torch.Tensor:
        """`(B, K, C, H, W)` the sample after each step: ``next_latents[:, k] == latents[:, k + 1]``."""
        return self.latents[:, 1:]


@dataclass
class PreferenceBatch:
    """Offline or semi-online preference pairs.

    Attributes:
        latents_w: `(B, C, H, W)` clean latents x_0 of the winning images (already scaled by the VAE scaling factor).
        latents_l: `(B, C, H, W)` clean latents of the losing images.
        prompts: the `B` prompts.
        prompt_embeds: encoded prompts (conditional only; preference losses use the unguided forward).
        ids: optional `(B,)` int64 data ids (used to check data order on resume).
        degraded_prompts: optional `B` semantically degraded prompts c⁻ that the losers were generated from (DDSPO
            pairs, `diffalign.data.ddspo_pairs`); `None` for other data.
        degraded_prompt_embeds: the encoded `degraded_prompts` (conditional only), or `None`.
    """

    latents_w: torch.Tensor
    latents_l: torch.Tensor
    prompts: list[str]
    prompt_embeds: PromptEmbeds
    ids: torch.Tensor | None = None
    degraded_prompts: list[str] | None = None
    degraded_prompt_embeds: PromptEmbeds | None = None

    sides = ("w", "l")  # the data sides a batch is made of (winners and losers)

    @classmethod
    def from_data(cls, data: dict[str, Any], latents: Callable[[str], torch.Tensor],
                  encode: Callable[[list[str]], PromptEmbeds]) -> PreferenceBatch:
        """A batch from a preference data set's collated `data` (``prompts``, ``ids``, optional
        ``degraded_prompts``), with `latents(side)` the clean latents of side "w" or "l" and `encode(prompts)` the
        conditional prompt embeddings."""
        latents_w = latents("w")
        embeds = encode(data["prompts"])
        latents_l = latents("l")
        degraded = data.get("degraded_prompts")
        return cls(latents_w, latents_l, data["prompts"], embeds, data["ids"], degraded_prompts=degraded,
                   degraded_prompt_embeds=None if degraded is None else encode(degraded))


@dataclass
class WinnerBatch:
    """Winning images only (SePPO's off-policy data, plain fine-tuning on winners).

    Attributes:
        latents_w: `(B, C, H, W)` clean latents x_0 of the winning images (already scaled by the VAE scaling factor).
        prompts: the `B` prompts.
        prompt_embeds: encoded prompts (conditional only).
        ids: optional `(B,)` int64 data ids.
    """

    latents_w: torch.Tensor
    prompts: list[str]
    prompt_embeds: PromptEmbeds
    ids: torch.Tensor | None = None

    sides = ("w",)  # the data sides a batch is made of (winners only)

    @classmethod
    def from_data(cls, data: dict[str, Any], latents: Callable[[str], torch.Tensor],
                  encode: Callable[[list[str]], PromptEmbeds]) -> WinnerBatch:
        """A batch from a data set's collated `data` (its losers, if any, unused); arguments as
        `PreferenceBatch.from_data`."""
        latents_w = latents("w")
        return cls(latents_w, data["prompts"], encode(data["prompts"]), data["ids"])


@dataclass
class RewardOutput:
    """What a reward returns.

    Attributes:
        scores: `(B,)` float32 scores (higher is better).
        info: extra per-sample values, e.g. ``{"correct": (B,) bool tensor, "details": list}``.
        maps: optional dense per-pixel scores `(B, H, W)` or per-frame-pixel `(B, F, H, W)`.
    """

    scores: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
    maps: torch.Tensor | None = None


@dataclass
class GroupBatch:
    """Online samples of prompt groups with their advantages (DGPO, GRPO-style methods).

    Attributes:
        latents: `(N, C, H, W)` clean final latents x_0 of the rollouts (model-native layout).
        prompts: the `N` prompts (``[p0]*G + [p1]*G + ...`` when whole groups are present).
        prompt_embeds: `N` rows; negatives present when a guided forward needs them.
        advantages: `(N,)` float32 group-relative advantages A_i.
        group_ids: `(N,)` int64 global group index of each sample.
        group_size: G, the number of samples per group (a group may span micro-batches or processes; its members'
            contributions are summed before the group's sigmoid weight is taken).
    """

    latents: torch.Tensor
    prompts: list[str]
    prompt_embeds: PromptEmbeds
    advantages: torch.Tensor
    group_ids: torch.Tensor
    group_size: int
