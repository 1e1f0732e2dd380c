"""Diffusion-DPO (Wallace et al., CVPR 2024, [arXiv:2311.12908](https://arxiv.org/abs/2311.12908)).

docs/methods/algorithms.md#diffusion-dpo. Offline preference pairs ``(c, x_0^w, x_0^l)``; per pair one timestep and one
noise draw shared by winner and loser; the reference is the initial model (``policy.reference()``) unless a reference
strategy of `diffalign.reference` is passed (e.g. a named checkpoint or an EMA).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.common import Generators, draw_timesteps_and_noise, per_sample_mse
from diffalign.runtime.console import warn_repeated
from diffalign.types import PreferenceBatch

if TYPE_CHECKING:
    from diffalign.models.base import DiffusionPolicy

logger = logging.getLogger(__name__)

SATURATION_THRESHOLD = 30.0
"""z above which `logsigmoid` is flat in float32 (σ(30) = 1 − 9.4e-14): the pair gives (almost) no gradient. Below
−30 it is not: −log σ(z) ≈ −z there, with gradient magnitude 1."""


def count_saturated(z: torch.Tensor, method: str, noun: str) -> torch.Tensor:
    """The number of entries of `z` above `SATURATION_THRESHOLD`, reported with `warn_repeated` (kind
    ``"saturated"``, once per run inside a training loop: ``per_run=True``).

    Such an entry is one the policy already ranks right by a wide margin (−log σ(z) < 1e-13): it gives ~0 gradient,
    as the sigmoid intends, and a batch of them logs a loss of 0.0. A few are expected once the policy learns (the
    default job's count: docs/guides/reliability.md#console-output); most of them saturating means β is too large
    for the loss scale. A pair with z < −30 is ranked wrong by a wide margin and gets the full gradient (not
    counted).

    Args:
        z (`torch.Tensor` of shape `(B,)`): the margins inside −log σ(z).
        method (`str`): the method's name in the warning, e.g. ``"Diffusion-DPO"``.
        noun (`str`): what a row is, e.g. ``"pairs"``.

    Returns:
        `torch.Tensor`: 0-dim int64, the count.
    """
    saturated = (z.detach() > SATURATION_THRESHOLD).sum()
    warn_repeated(logger, "saturated", f"{method}: {{count}} of {{of}} {noun} had z > {SATURATION_THRESHOLD:.0f}: "
                  "already ranked right by a wide margin, ~0 gradient from them (logsigmoid flat); a few are "
                  "expected, lower method.beta only if most are", count=int(saturated), of=z.shape[0], per_run=True)
    return saturated


def diffusion_dpo_loss(
    model_losses_w: torch.Tensor,
    model_losses_l: torch.Tensor,
    ref_losses_w: torch.Tensor,
    ref_losses_l: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""Diffusion-DPO loss from per-sample denoising losses.

    arXiv:2311.12908 Eq. 14, in the form of the authors' code (constant weighting, prefactor β/2):

    $$z = -\frac{\beta}{2}\big[(\ell_\theta^w - \ell_{ref}^w) - (\ell_\theta^l - \ell_{ref}^l)\big],\qquad
    \mathcal{L} = \operatorname{mean}_{\text{pairs}} -\log\sigma(z).$$

    With the policy equal to the reference, ``z = 0`` and the loss is ``ln 2 ≈ 0.693147`` (not 0).
    The implicit rewards are ``r^w = -β/2 (ℓ_θ^w - ℓ_ref^w)`` and ``r^l = -β/2 (ℓ_θ^l - ℓ_ref^l)``, so ``z = r^w - r^l``.

    Args:
        model_losses_w (`torch.Tensor` of shape `(B,)`):
            Policy per-sample losses ℓ_θ^w of the winners (`per_sample_mse`), ≥ 0; carries the gradient.
        model_losses_l (`torch.Tensor` of shape `(B,)`):
            Policy per-sample losses ℓ_θ^l of the losers.
        ref_losses_w (`torch.Tensor` of shape `(B,)`):
            Reference per-sample losses ℓ_ref^w of the winners (no gradient needed).
        ref_losses_l (`torch.Tensor` of shape `(B,)`):
            Reference per-sample losses ℓ_ref^l of the losers.
        beta (`float`):
            KL strength β > 0 (5000 in the released SD1.5/SDXL launchers, for mean-reduced ε losses).

    Returns:
        `tuple(torch.Tensor, dict[str, torch.Tensor])`: the scalar float32 loss (≥ 0) and detached 0-dim float32
        metrics:

        - ``loss``: the loss value.
        - ``implicit_acc``: fraction of pairs with ``z > 0`` (strictly; a tie at ``z = 0`` counts as wrong), in [0, 1].
        - ``rewards/chosen``, ``rewards/rejected``: mean implicit rewards ``r^w`` and ``r^l``.
        - ``rewards/margins``: mean ``z``.
        - ``model_loss/chosen``, ``model_loss/rejected``, ``ref_loss/chosen``, ``ref_loss/rejected``: mean losses.
        - ``saturated``: number of pairs with ``z > 30`` (`count_saturated`): already ranked right by a wide margin,
            they give ~0 gradient, and a batch of them can log a loss of exactly 0.0; a warning is logged whenever
            the count is non-zero (inside a training loop: counted and reported once per run,
            `diffalign.runtime.console.warn_repeated`).

    Raises:
        ValueError: if `beta` ≤ 0 or the four inputs are not 1-D tensors of one shape.
    """
    if beta <= 0:
        raise ValueError(f"beta={beta} must be > 0 (set method.beta, e.g. 5000 for SD1.5/SDXL ε-prediction).")
    shapes = {t.shape for t in (model_losses_w, model_losses_l, ref_losses_w, ref_losses_l)}
    if len(shapes) != 1 or model_losses_w.ndim != 1:
        raise ValueError(
            "diffusion_dpo_loss expects four per-sample loss vectors of one shape (B,); got shapes "
            f"{[tuple(s) for s in (model_losses_w.shape, model_losses_l.shape, ref_losses_w.shape, ref_losses_l.shape)]}."
            " Reduce each with per_sample_mse first."
        )
    model_w, model_l = model_losses_w.float(), model_losses_l.float()
    ref_w, ref_l = ref_losses_w.float(), ref_losses_l.float()
    reward_w = -0.5 * beta * (model_w - ref_w)
    reward_l = -0.5 * beta * (model_l - ref_l)
    z = reward_w - reward_l
    loss = -F.logsigmoid(z).mean()

    saturated = count_saturated(z, "Diffusion-DPO", "pairs")
    metrics = {
        "loss": loss.detach(),
        "implicit_acc": (z.detach() > 0).float().mean(),
        "rewards/chosen": reward_w.detach().mean(),
        "rewards/rejected": reward_l.detach().mean(),
        "rewards/margins": z.detach().mean(),
        "model_loss/chosen": model_w.detach().mean(),
        "model_loss/rejected": model_l.detach().mean(),
        "ref_loss/chosen": ref_w.detach().mean(),
        "ref_loss/rejected": ref_l.detach().mean(),
        "saturated": saturated.float(),
    }
    return loss, metrics


@config_schema("method", "diffusion_dpo")
@dataclass
class DiffusionDPOConfig:
    """Config of `DiffusionDPO`; the one place its defaults are written (the method is built from it:
    `diffalign.methods.method_config`)."""

    _target_: str = "diffalign.objectives.diffusion_dpo.DiffusionDPO"
    beta: float = 5000.0
    timestep_min: int = 0
    timestep_max: int | None = None


class DiffusionDPO(nn.Module):
    r"""Diffusion-DPO objective (arXiv:2311.12908 Eq. 14; docs/methods/algorithms.md#diffusion-dpo).

    One call, for a batch of ``B`` pairs:

    1. draw one ``t ~ U{timestep_min..timestep_max}`` and one ``ε ~ N(0, I)`` per pair, shared by winner and loser;
    2. noise the ``2B`` latents ``[x_0^w; x_0^l]`` with `policy.add_noise`;
    3. run the policy unguided (``guidance_scale=1``) on the ``2B`` batch, and the reference the same way under
       ``torch.no_grad()`` and ``policy.reference()`` (or ``reference.use(policy)`` when a strategy is passed);
    4. reduce with `per_sample_mse` against `policy.training_target` (ε or v) and apply `diffusion_dpo_loss`.

    The module has no parameters: the trainable weights live in the policy.

    Built from `DiffusionDPOConfig`, the one place its defaults are written: ``DiffusionDPO(config)`` or
    ``DiffusionDPO(**fields)`` (the fields not given keep their `DiffusionDPOConfig` defaults;
    `diffalign.methods.method_config`).

    Fields:
        beta (`float`):
            KL strength β > 0 (released SD1.5/SDXL value; the paper/SePPO also quote 2000). β does not transfer
            between ε, v and flow parametrizations (docs/methods/algorithms.md#forward-processes).
        timestep_min (`int`):
            Smallest training timestep drawn, inclusive, ≥ 0.
        timestep_max (`int`, *optional*):
            Largest training timestep drawn, inclusive; `None` means ``num_train_timesteps - 1`` of the policy's
            scheduler (999 for SD).

    Raises:
        ValueError: at construction if `beta` ≤ 0 or the timestep range is empty or negative; at the first call if
            `timestep_max` is beyond the scheduler's ``num_train_timesteps - 1``.
    """

    data_flow = "pairs"

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """No checks beyond its constructor's (the method contract, `diffalign.methods`)."""

    def setup(self, policy) -> None:
        """Nothing to add to the policy."""

    def checkpoint_states(self) -> dict:
        """No state beyond the reference strategy's."""
        return {}

    def __init__(self, config: DiffusionDPOConfig | None = None, **fields):
        config = method_config(DiffusionDPOConfig, config, fields)
        super().__init__()
        if config.beta <= 0:
            raise ValueError(f"method.beta={config.beta} must be > 0; use e.g. method.beta=5000 (Diffusion-DPO "
                             "SD1.5/SDXL).")
        if config.timestep_min < 0:
            raise ValueError(f"method.timestep_min={config.timestep_min} must be ≥ 0.")
        if config.timestep_max is not None and config.timestep_max < config.timestep_min:
            raise ValueError(
                f"method.timestep_max={config.timestep_max} is below method.timestep_min={config.timestep_min}; "
                "set timestep_max ≥ timestep_min, or null for the scheduler's last timestep."
            )
        self.beta = config.beta
        self.timestep_min = config.timestep_min
        self.timestep_max = config.timestep_max

    def extra_repr(self) -> str:
        return f"beta={self.beta}, timestep_min={self.timestep_min}, timestep_max={self.timestep_max}"

    def forward(
        self,
        policy: DiffusionPolicy,
        batch: PreferenceBatch,
        generator: Generators = None,
        reference: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Computes the Diffusion-DPO loss for a batch of pairs.

        Args:
            policy (`DiffusionPolicy`, e.g. `StableDiffusionPolicy`):
                Only ``predict(latents, timesteps, prompt_embeds, guidance_scale)``, ``add_noise``,
                ``training_target``, the ``reference()`` context manager and ``scheduler.config.num_train_timesteps``
                are used.
            batch (`PreferenceBatch`):
                ``latents_w``/``latents_l`` of shape `(B, C, H, W)` (scaled VAE latents) and `B` prompt embeddings.
            generator (`torch.Generator` or a list of `B`, *optional*):
                Source of the timesteps and noise. Both are drawn in float32 on the generator's device (CPU when `None`,
                from the global RNG) and then moved to the latents' device and dtype, so one CPU generator reproduces
                the same draws on any device and precision. A list gives each pair its own generator
                (`diffalign.objectives.common.randn`), as the training loop does.
            reference (*optional*):
                A reference strategy of `diffalign.reference` (``reference.use(policy)`` runs the reference model).
                `None` uses ``policy.reference()``, the adapter-disabled base, which is what the default
                ``reference=frozen_base`` does too (bit-for-bit).

        Returns:
            `tuple(torch.Tensor, dict[str, torch.Tensor])`: the scalar loss (with gradient through the policy) and
            the metrics of `diffusion_dpo_loss`.

        Raises:
            ValueError: if winner and loser latents differ in shape, the prompt embeddings do not have `B` rows, or
                `timestep_max` exceeds the scheduler's range.
        """
        latents_w, latents_l = batch.latents_w, batch.latents_l
        if latents_w.shape != latents_l.shape:
            raise ValueError(
                f"batch.latents_w has shape {tuple(latents_w.shape)} but batch.latents_l has shape "
                f"{tuple(latents_l.shape)}; winner and loser must be encoded at the same resolution."
            )
        bsz = latents_w.shape[0]
        if len(batch.prompt_embeds) != bsz:
            raise ValueError(
                f"batch.prompt_embeds has {len(batch.prompt_embeds)} rows for {bsz} pairs; pass one row per pair."
            )
        # One (t, ε) per pair, repeated for the loser half: rows [w_0..w_{B-1}, l_0..l_{B-1}].
        timesteps, noise = draw_timesteps_and_noise(policy, tuple(latents_w.shape), self.timestep_min,
                                                    self.timestep_max, generator)
        timesteps = timesteps.to(latents_w.device).repeat(2)
        noise = noise.to(latents_w.device, latents_w.dtype).repeat(2, *([1] * (latents_w.ndim - 1)))

        latents = torch.cat([latents_w, latents_l])
        rows = torch.arange(bsz, device=batch.prompt_embeds.prompt_embeds.device).repeat(2)
        prompt_embeds = batch.prompt_embeds.index(rows)
        noisy_latents = policy.add_noise(latents, noise, timesteps)
        target = policy.training_target(latents, noise, timesteps)

        model_pred = policy.predict(noisy_latents, timesteps, prompt_embeds, guidance_scale=1.0)
        model_losses = per_sample_mse(model_pred, target)
        with torch.no_grad(), (policy.reference() if reference is None else reference.use(policy)):
            ref_pred = policy.predict(noisy_latents, timesteps, prompt_embeds, guidance_scale=1.0)
            ref_losses = per_sample_mse(ref_pred, target)

        return diffusion_dpo_loss(
            model_losses[:bsz], model_losses[bsz:], ref_losses[:bsz], ref_losses[bsz:], beta=self.beta
        )
