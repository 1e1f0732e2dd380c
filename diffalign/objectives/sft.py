"""Plain supervised fine-tuning on winning images (the "SFT^w" baseline of SePPO, arXiv:2410.05255;
docs/methods/algorithms.md#sft-on-winners).

The denoising loss (docs/methods/algorithms.md#denoising-loss) on the winners alone, no reference and no preference:
the baseline SePPO is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.common import Generators, draw_timesteps_and_noise, per_sample_mse
from diffalign.types import WinnerBatch

if TYPE_CHECKING:
    from diffalign.models.base import DiffusionPolicy


@config_schema("method", "sft")
@dataclass
class WinnerSFTConfig:
    """Config of `WinnerSFT`; the one place its defaults are written (the method is built from it:
    `diffalign.methods.method_config`)."""

    _target_: str = "diffalign.objectives.sft.WinnerSFT"
    timestep_min: int = 0
    timestep_max: int | None = None


class WinnerSFT(nn.Module):
    r"""Fine-tuning on winners: $\mathcal L=\operatorname{mean}_{b}\ \ell_\theta(x^w_b,\epsilon_b,t_b,c_b)$ with
    ``t ~ U{timestep_min..timestep_max}`` and ``ε ~ N(0, I)`` per sample (docs/methods/algorithms.md#denoising-loss;
    the DDPM loss of Ho et al., arXiv:2006.11239 Eq. 14, mean-reduced).

    Built from `WinnerSFTConfig`, the one place its defaults are written: ``WinnerSFT(config)`` or
    ``WinnerSFT(**fields)`` (the fields not given keep their `WinnerSFTConfig` defaults;
    `diffalign.methods.method_config`).

    Fields:
        timestep_min (`int`): smallest timestep drawn, inclusive, ≥ 0.
        timestep_max (`int`, *optional*): largest timestep drawn, inclusive; `None` means the scheduler's last.

    Raises:
        ValueError: naming ``method.timestep_min``/``method.timestep_max`` for an empty or negative range, or a
            ``timestep_max`` beyond the scheduler's range (at call time).
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

    def __init__(self, config: WinnerSFTConfig | None = None, **fields):
        config = method_config(WinnerSFTConfig, config, fields)
        super().__init__()
        if config.timestep_min < 0:
            raise ValueError(f"method.timestep_min={config.timestep_min} must be >= 0.")
        if config.timestep_max is not None and config.timestep_max < config.timestep_min:
            raise ValueError(f"method.timestep_max={config.timestep_max} is below method.timestep_min="
                             f"{config.timestep_min}.")
        self.timestep_min, self.timestep_max = config.timestep_min, config.timestep_max

    def forward(
        self, policy: DiffusionPolicy, batch: WinnerBatch, generator: Generators = None, reference: Any = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Returns the mean denoising loss of the winners (scalar, with gradient) and ``{"loss"}``; `reference` is
        accepted for the loop's uniform call and ignored.

        Raises:
            ValueError: if `timestep_max` exceeds the scheduler's range.
        """
        latents = batch.latents_w
        timesteps, noise = draw_timesteps_and_noise(policy, tuple(latents.shape), self.timestep_min,
                                                    self.timestep_max, generator)
        timesteps = timesteps.to(latents.device)
        noise = noise.to(latents.device, latents.dtype)
        pred = policy.predict(policy.add_noise(latents, noise, timesteps), timesteps, batch.prompt_embeds, 1.0)
        loss = per_sample_mse(pred, policy.training_target(latents, noise, timesteps)).mean()
        return loss, {"loss": loss.detach()}
