"""SePPO: Semi-Policy Preference Optimization (Zhang et al., [arXiv:2410.05255](https://arxiv.org/abs/2410.05255)).

docs/methods/algorithms.md#seppo. SePPO trains on winning images only. A previous checkpoint θ_r of the policy, drawn
from a pool (`diffalign.reference.pool.PoolReference`), is both the DPO reference and the generator of an on-policy
*reference sample* x^r that takes the loser's place; the anchor-based adaptive flipper (AAF) decides per sample whether
x^r is treated as a loser (s = +1) or as a likely winner (s = −1, or 0 in the "switch to SFT" form of the paper's v2).

SePPO has no public training code, so the points docs/methods/algorithms.md#seppo marks [INFERRED] are explicit choices
here, each a field:

=====================================  ==========================================  =============================
INFERRED item                           default                                     field
=====================================  ==========================================  =============================
t and ε shared by x^w and x^r           shared (Diffusion-DPO convention)           ``share_noise``
AAF tie ℓ_θr(x^w) = ℓ_θ(x^w)            x^r treated as a loser (s = +1, or 1)       ``aaf_tie``
sampler of x^r                          the run's ``sampler`` node (recipes: DDIM,  ``sampler`` (``${sampler}``)
                                        η = 0, i.e. the ODE sampler)
x^r kept as the sampler's latent or     the latent (no VAE round trip)              ``sample_reencode``
decoded and re-encoded like x^w
x^r reuse within a selection stage      one x^r per prompt per stage (cached)       ``sample_cache``
draw granularity of θ_r                 once per stage                              ``reference.redraw``
pool eviction beyond K                  keep θ_0, drop the oldest after it          ``reference.keep_initial``
β prefactor β/2 vs βTω(λ_t)             β/2 (Diffusion-DPO code); another constant  ``beta``
                                        prefactor is the same loss with another β
=====================================  ==========================================  =============================
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.common import (
    Generators,
    check_timestep_range,
    draw_timesteps_and_noise,
    per_sample_mse,
    randint,
    randn,
)
from diffalign.objectives.diffusion_dpo import count_saturated
from diffalign.samplers.base import build_sampler
from diffalign.samplers.rollout import rollout
from diffalign.types import WinnerBatch

if TYPE_CHECKING:
    from diffalign.models.base import DiffusionPolicy

logger = logging.getLogger(__name__)

AAF_MODES = ("sign", "indicator", "off")
SAMPLE_CACHE_MODES = ("prompt", "off")


def anchor_flip(model_losses_w: torch.Tensor, ref_losses_w: torch.Tensor, aaf_mode: str, aaf_tie: str) -> torch.Tensor:
    r"""The anchor-based adaptive flipper (AAF) s of SePPO (arXiv:2410.05255, as restated in
    docs/methods/algorithms.md#seppo; the paper's full text was not available, so its equation numbers are not cited).

    With the winner x^w as anchor and a single Monte-Carlo draw (the loss's own t, ε), no gradient:

    - ``"sign"`` (paper v1): $s=\operatorname{sign}(\ell_{\theta_r}(x^w)-\ell_\theta(x^w))$: +1 when the policy fits the
      anchor better than θ_r (x^r is treated as a loser), −1 when θ_r fits it better (x^r is likely a winner);
    - ``"indicator"`` (the 𝟙(·) ablation, ≈ the v2 "switch to SFT"): 1 or 0 in the same cases;
    - ``"off"``: always +1 (SePPO without AAF, i.e. Diffusion-DPO with x^r as the loser).

    Ties (equal losses, e.g. at the first step where θ = θ_r) count as "x^r is a loser" with ``aaf_tie="loser"`` and as
    "likely a winner" with ``aaf_tie="winner"``.

    Args:
        model_losses_w (`torch.Tensor` of shape `(B,)`): ℓ_θ(x^w).
        ref_losses_w (`torch.Tensor` of shape `(B,)`): ℓ_θr(x^w).
        aaf_mode (`str`): "sign", "indicator" or "off".
        aaf_tie (`str`): "loser" or "winner".

    Returns:
        `torch.Tensor` `(B,)` float32, detached, values in {+1, −1} ("sign"), {1, 0} ("indicator") or {1} ("off").

    Raises:
        ValueError: for an unknown `aaf_mode` or `aaf_tie` (naming ``method.aaf_mode`` / ``method.aaf_tie``).
    """
    if aaf_mode not in AAF_MODES:
        raise ValueError(f"method.aaf_mode={aaf_mode!r} must be one of {list(AAF_MODES)}.")
    if aaf_tie not in ("loser", "winner"):
        raise ValueError(f"method.aaf_tie={aaf_tie!r} must be 'loser' or 'winner'.")
    gap = (ref_losses_w.detach() - model_losses_w.detach()).float()
    as_loser = (gap > 0) | ((gap == 0) & (aaf_tie == "loser"))
    if aaf_mode == "off":
        return torch.ones_like(gap)
    flipped = -1.0 if aaf_mode == "sign" else 0.0
    return torch.where(as_loser, torch.ones_like(gap), torch.full_like(gap, flipped))


def seppo_loss(
    model_losses_w: torch.Tensor,
    model_losses_r: torch.Tensor,
    ref_losses_w: torch.Tensor,
    ref_losses_r: torch.Tensor,
    beta: float,
    aaf_mode: str = "sign",
    aaf_tie: str = "loser",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""SePPO loss from per-sample denoising losses (arXiv:2410.05255, docs/methods/algorithms.md#seppo: the
    Diffusion-DPO loss of arXiv:2311.12908 Eq. 14 with x^r as the second sample, θ_r as the reference and the AAF sign
    s).

    $$\Delta_w=\ell_\theta(x^w)-\ell_{\theta_r}(x^w),\quad \Delta_r=\ell_\theta(x^r)-\ell_{\theta_r}(x^r),\quad
    z=-\tfrac{\beta}{2}\big[\Delta_w-s\,\Delta_r\big],\quad \mathcal L=\operatorname{mean}-\log\sigma(z),$$

    with s from `anchor_flip`. With s ≡ +1 this is `diffusion_dpo_loss` with x^r as the loser and θ_r as the
    reference; with θ = θ_r, z = 0 and the loss is ln 2.

    Args:
        model_losses_w (`torch.Tensor` of shape `(B,)`): ℓ_θ(x^w) ≥ 0, with gradient.
        model_losses_r (`torch.Tensor` of shape `(B,)`): ℓ_θ(x^r), with gradient.
        ref_losses_w (`torch.Tensor` of shape `(B,)`): ℓ_θr(x^w).
        ref_losses_r (`torch.Tensor` of shape `(B,)`): ℓ_θr(x^r).
        beta (`float`): β > 0 (SePPO quotes 2000, the Diffusion-DPO launchers use 5000).
        aaf_mode (`str`, defaults to "sign"): see `anchor_flip`.
        aaf_tie (`str`, defaults to "loser"): see `anchor_flip`.

    Returns:
        `tuple(torch.Tensor, dict[str, torch.Tensor])`: the scalar float32 loss and detached 0-dim metrics:

        - ``loss``; ``implicit_acc``: fraction with z > 0 (strict);
        - ``flip_rate``: fraction of samples whose x^r is treated as a likely winner (s ≠ +1), in [0, 1];
        - ``implicit_acc/winner_vs_sample``: fraction with r^w > r^r, whatever s;
        - ``rewards/chosen`` r^w = −β/2 Δ_w, ``rewards/reference_sample`` r^r = −β/2 Δ_r, ``rewards/margins`` mean z;
        - ``anchor_gap``: mean ℓ_θr(x^w) − ℓ_θ(x^w), the AAF statistic (> 0: the policy fits winners better);
        - ``model_loss/chosen``, ``model_loss/reference_sample``, ``ref_loss/chosen``, ``ref_loss/reference_sample``;
        - ``saturated``: number of samples with z > 30, ~0 gradient (`diffalign.objectives.diffusion_dpo.
            count_saturated`: a warning is logged when non-zero; inside a training loop, once per run).

    Raises:
        ValueError: if `beta` ≤ 0, the inputs are not four `(B,)` tensors, or `aaf_mode`/`aaf_tie` is unknown.
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0 (set method.beta, e.g. 2000 as in SePPO).")
    shapes = {t.shape for t in (model_losses_w, model_losses_r, ref_losses_w, ref_losses_r)}
    if len(shapes) != 1 or model_losses_w.ndim != 1:
        raise ValueError(
            f"seppo_loss expects four per-sample loss vectors of one shape (B,); got {[tuple(s) for s in shapes]}."
            " Reduce each with per_sample_mse first."
        )
    model_w, model_r = model_losses_w.float(), model_losses_r.float()
    ref_w, ref_r = ref_losses_w.float(), ref_losses_r.float()
    s = anchor_flip(model_w, ref_w, aaf_mode, aaf_tie)
    reward_w = -0.5 * beta * (model_w - ref_w)
    reward_r = -0.5 * beta * (model_r - ref_r)
    z = reward_w - s * reward_r
    loss = -F.logsigmoid(z).mean()

    saturated = count_saturated(z, "SePPO", "samples")
    metrics = {
        "loss": loss.detach(),
        "implicit_acc": (z.detach() > 0).float().mean(),
        "flip_rate": (s != 1).float().mean(),
        "implicit_acc/winner_vs_sample": (reward_w.detach() > reward_r.detach()).float().mean(),
        "rewards/chosen": reward_w.detach().mean(),
        "rewards/reference_sample": reward_r.detach().mean(),
        "rewards/margins": z.detach().mean(),
        "anchor_gap": (ref_w - model_w).detach().mean(),
        "model_loss/chosen": model_w.detach().mean(),
        "model_loss/reference_sample": model_r.detach().mean(),
        "ref_loss/chosen": ref_w.detach().mean(),
        "ref_loss/reference_sample": ref_r.detach().mean(),
        "saturated": saturated.float(),
    }
    return loss, metrics


def reference_sample_seed(sample_seed: int, version: int, prompt: str) -> int:
    """Generator seed of the reference sample for `prompt` in selection stage `version` (``sample_cache="prompt"``):
    the first 8 bytes of SHA-256(``f"{sample_seed}/{version}/{prompt}"``) as an int below 2**63."""
    digest = hashlib.sha256(f"{sample_seed}/{version}/{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@config_schema("method", "seppo")
@dataclass
class SePPOConfig:
    """Config of `SePPO`; the one place its defaults are written (the method is built from it:
    `diffalign.methods.method_config`)."""

    _target_: str = "diffalign.objectives.seppo.SePPO"
    beta: float = 2000.0
    aaf_mode: str = "sign"
    aaf_tie: str = "loser"
    share_noise: bool = True
    timestep_min: int = 0
    timestep_max: int | None = None
    sampler: Any = None  # the reference sampler, a sampler node (configs/method/seppo.yaml: the run's ${sampler})
    sample_reencode: bool = False
    sample_cache: str = "prompt"
    sample_seed: int = 0


class SePPO(nn.Module):
    r"""SePPO objective (arXiv:2410.05255; docs/methods/algorithms.md#seppo).

    One call, for a batch of ``B`` winners ``(c, x_0^w)`` and a reference strategy whose θ_r is current:

    1. draw ``t ~ U{timestep_min..timestep_max}`` and ``ε ~ N(0, I)`` per sample from `generator` (in this order, as
       `DiffusionDPO` does), shared by x^w and x^r unless ``share_noise=False`` (then a second ε is drawn for x^r);
    2. get x^r ~ p_θr(·|c): rollouts (`diffalign.samplers.rollout.rollout`) of θ_r under ``reference.use(policy)``
       with `sampler`. With ``sample_cache="prompt"`` there is one x^r per prompt and selection stage:
       its generator seed is `reference_sample_seed` (``sample_seed``, ``reference.version``, prompt), and it is kept
       in ``reference.samples`` (emptied when θ_r changes, saved with checkpoints) and reused for every winner with
       that prompt in the stage. With ``"off"`` every winner gets a fresh x^r whose seed is drawn from `generator`
       after t and ε;
    3. the policy runs unguided on ``[x^w_t; x^r_t]`` with gradient, θ_r the same under ``torch.no_grad()`` and
       ``reference.use(policy)``; per-sample losses against `policy.training_target`, then `seppo_loss`.

    Built from `SePPOConfig`, the one place its defaults are written: ``SePPO(config)`` or ``SePPO(**fields)`` (the
    fields not given keep their `SePPOConfig` defaults; `diffalign.methods.method_config`).

    Fields:
        beta (`float`): β > 0 (SePPO's quoted value; docs/methods/algorithms.md#seppo suggests
            sweeping {2000, 5000}).
        aaf_mode (`str`): "sign" (v1), "indicator" (≈ v2) or "off" (no flipper).
        aaf_tie (`str`): how a tie on the anchor counts (INFERRED), see `anchor_flip`.
        share_noise (`bool`): share t and ε between x^w and x^r (INFERRED, Diffusion-DPO convention).
        timestep_min (`int`), timestep_max (`int`, *optional*): training timestep range, inclusive;
            `None` means the scheduler's last timestep.
        sampler (`Sampler` or a ``sampler`` config node, *optional*): the reference sampler, needed to train
            (``configs/method/seppo.yaml`` passes the run's ``sampler`` node; the SePPO recipes use DDIM with η = 0,
            the ODE-like deterministic DDIM).
        sample_reencode (`bool`): decode x^r to pixels and re-encode it with the VAE, as the winners
            are encoded, instead of using the sampler's latent.
        sample_cache (`str`): "prompt" or "off", see step 2. The cache holds one latent per
            distinct prompt of a stage (64 KiB each at SD1.5 size); use "off" for large prompt sets.
        sample_seed (`int`): base seed of the reference samples.

    Raises:
        ValueError: at construction, naming the ``method.*`` field, for β ≤ 0, an unknown mode, an empty timestep
            range, or a bad sampler (`ConfigError` naming ``sampler.<field>``); at call time, without a reference strategy or for a timestep
            beyond the scheduler's range.
    """

    data_flow = "winners"

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """No checks beyond its constructor's (the method contract, `diffalign.methods`)."""

    def setup(self, policy) -> None:
        """Nothing to add to the policy."""

    def checkpoint_states(self) -> dict:
        """No state beyond the reference strategy's."""
        return {}

    def __init__(self, config: SePPOConfig | None = None, **fields):
        config = method_config(SePPOConfig, config, fields)
        super().__init__()
        if config.beta <= 0:
            raise ValueError(f"method.beta={config.beta} must be > 0; use e.g. method.beta=2000 (SePPO).")
        if config.aaf_mode not in AAF_MODES:
            raise ValueError(f"method.aaf_mode={config.aaf_mode!r} must be one of {list(AAF_MODES)}.")
        if config.aaf_tie not in ("loser", "winner"):
            raise ValueError(f"method.aaf_tie={config.aaf_tie!r} must be 'loser' or 'winner'.")
        check_timestep_range(config)
        if config.sample_cache not in SAMPLE_CACHE_MODES:
            raise ValueError(f"method.sample_cache={config.sample_cache!r} must be one of {list(SAMPLE_CACHE_MODES)}.")
        self.sampler = None if config.sampler is None else build_sampler(config.sampler, "sampler")
        self.beta, self.aaf_mode, self.aaf_tie = config.beta, config.aaf_mode, config.aaf_tie
        self.share_noise = config.share_noise
        self.timestep_min, self.timestep_max = config.timestep_min, config.timestep_max
        self.sample_reencode, self.sample_cache = config.sample_reencode, config.sample_cache
        self.sample_seed = config.sample_seed

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, aaf_mode={self.aaf_mode!r}, aaf_tie={self.aaf_tie!r}, share_noise="
                f"{self.share_noise}, sampler={self.sampler!r}, cache={self.sample_cache!r}")

    @torch.no_grad()
    def reference_samples(
        self, policy: DiffusionPolicy, prompts: list[str], reference: Any, seeds: list[int] | None = None
    ) -> tuple[torch.Tensor, int]:
        """x^r for each prompt, sampled by θ_r (step 2 of the class docstring).

        Args:
            policy (`DiffusionPolicy`): the policy (θ_r is swapped in with ``reference.use(policy)``).
            prompts (`list[str]`): `B` prompts.
            reference: the reference strategy (`diffalign.reference`), with ``use``, ``version`` and ``samples``.
            seeds (`list[int]`, *optional*): `B` generator seeds, required with ``sample_cache="off"`` and ignored
                with "prompt".

        Returns:
            `tuple(torch.Tensor, int)`: `(B, C, H, W)` float32 scaled latents x^r_0 on the policy's device, and how
            many rows found their x^r in the cache before this call.
        """
        if self.sample_cache == "prompt":
            keys = list(prompts)
            hits = sum(p in reference.samples.items for p in keys)
            todo = list(dict.fromkeys(p for p in keys if p not in reference.samples.items))
            todo_seeds = [reference_sample_seed(self.sample_seed, reference.version, p) for p in todo]
        else:
            keys, todo, todo_seeds, hits = None, list(prompts), list(seeds), 0
        fresh = None
        if todo:
            generators = [torch.Generator(device="cpu").manual_seed(s) for s in todo_seeds]
            with reference.use(policy):
                if self.sampler is None:
                    raise ValueError("SePPO samples x^r with its sampler, and none was given: pass sampler= (the run "
                                     "config's method.sampler is ${sampler})")
                trajectory = rollout(policy, todo, self.sampler, generator=generators, decode=self.sample_reencode)
            fresh = trajectory.latents[:, -1]
            if self.sample_reencode:
                fresh = policy.encode_images(trajectory.images)
        if keys is None:
            return fresh.float(), 0
        for prompt, latent in zip(todo, [] if fresh is None else fresh):
            reference.samples.items[prompt] = latent.detach().float().cpu().clone()
        return torch.stack([reference.samples.items[p] for p in keys]).to(policy.device), hits

    def forward(
        self,
        policy: DiffusionPolicy,
        batch: WinnerBatch,
        generator: Generators = None,
        reference: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Computes the SePPO loss for a batch of winners.

        Args:
            policy (`DiffusionPolicy`, e.g. `StableDiffusionPolicy`): uses ``predict``, ``add_noise``,
                ``training_target``, ``encode_prompts`` (through the rollout), ``scheduler`` and ``device``.
            batch (`WinnerBatch`): ``latents_w`` `(B, C, H, W)`, `B` prompts and their embeddings.
            generator (`torch.Generator` or a list of `B`, *optional*): source of t, ε (and, with
                ``sample_cache="off"``, the x^r seeds), drawn in float32 on the generator's device and moved to the
                latents' device; a list gives each winner its own (`diffalign.objectives.common.randn`).
            reference: the reference strategy holding θ_r (`diffalign.reference.pool.PoolReference` for SePPO; any
                strategy works, e.g. `FrozenBaseReference` gives a DITTO-like fixed reference).

        Returns:
            `tuple(torch.Tensor, dict[str, torch.Tensor])`: the loss (with gradient through the policy) and the metrics
            of `seppo_loss` plus ``reference/cache_hits`` (fraction of x^r taken from the stage cache).

        Raises:
            ValueError: without `reference`, if the prompt embeddings do not have `B` rows, or `timestep_max` exceeds
                the scheduler's range.
        """
        if reference is None:
            raise ValueError("SePPO needs a reference strategy holding θ_r (diffalign.reference); the training loop "
                             "passes the one configured by `reference=` (SePPO: reference=pool).")
        latents_w = batch.latents_w
        bsz = latents_w.shape[0]
        if len(batch.prompt_embeds) != bsz or len(batch.prompts) != bsz:
            raise ValueError(f"batch has {bsz} winners but {len(batch.prompts)} prompts and "
                             f"{len(batch.prompt_embeds)} prompt embeddings; pass one of each per winner.")
        # 1. one (t, ε) per winner, reused for its reference sample: rows [w_0..w_{B-1}, r_0..r_{B-1}]
        timesteps, noise = draw_timesteps_and_noise(policy, tuple(latents_w.shape), self.timestep_min,
                                                    self.timestep_max, generator)
        noise_r = noise if self.share_noise else randn(tuple(latents_w.shape), generator)
        seeds = None
        if self.sample_cache == "off":
            seeds = randint(0, 2**62, bsz, generator).tolist()

        # 2. reference samples x^r ~ p_θr(·|c)
        latents_r, hits = self.reference_samples(policy, list(batch.prompts), reference, seeds)
        latents_r = latents_r.to(latents_w.device, latents_w.dtype)

        # 3. policy and θ_r on the shared noisy batch
        timesteps = timesteps.to(latents_w.device).repeat(2)
        noise = torch.cat([noise, noise_r]).to(latents_w.device, latents_w.dtype)
        latents = torch.cat([latents_w, latents_r])
        rows = torch.arange(bsz, device=batch.prompt_embeds.prompt_embeds.device).repeat(2)
        prompt_embeds = batch.prompt_embeds.index(rows)
        noisy_latents = policy.add_noise(latents, noise, timesteps)
        target = policy.training_target(latents, noise, timesteps)

        model_losses = per_sample_mse(policy.predict(noisy_latents, timesteps, prompt_embeds, guidance_scale=1.0),
                                      target)
        with torch.no_grad(), reference.use(policy):
            ref_losses = per_sample_mse(policy.predict(noisy_latents, timesteps, prompt_embeds, guidance_scale=1.0),
                                        target)
        loss, metrics = seppo_loss(model_losses[:bsz], model_losses[bsz:], ref_losses[:bsz], ref_losses[bsz:],
                                   beta=self.beta, aaf_mode=self.aaf_mode, aaf_tie=self.aaf_tie)
        metrics["reference/cache_hits"] = torch.tensor(hits / bsz)
        return loss, metrics
