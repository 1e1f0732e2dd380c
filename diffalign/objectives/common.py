"""Small numerical helpers shared by the objectives."""

from __future__ import annotations

import torch


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    r"""Per-sample denoising ("DSM") loss, ALGORITHMS.md §1.2.

    Computes $\ell = \operatorname{mean}_{\text{all non-batch dims}} (\text{pred} - \text{target})^2$ in float32,
    whatever the input dtype, so fp16/bf16 network outputs do not lose the small loss differences that preference
    objectives compare. Every β in the method configs assumes this mean (not sum) reduction.

    Args:
        pred (`torch.Tensor` of shape `(B, ...)`):
            Network output, e.g. `(B, C, H, W)` for images or `(B, C, F, H, W)` for video latents; any float dtype.
        target (`torch.Tensor` of the same shape as `pred`):
            Regression target (ε, v or x₀, see `policy.training_target`).

    Returns:
        `torch.Tensor` of shape `(B,)`, float32, ≥ 0: the mean squared error of each sample. Differentiable with
        respect to both inputs.

    Raises:
        ValueError: if the shapes differ or the inputs have no batch dimension.
    """
    if pred.shape != target.shape:
        raise ValueError(
            f"per_sample_mse: pred has shape {tuple(pred.shape)} but target has shape {tuple(target.shape)}; "
            "pass a target with the prediction's shape (see policy.training_target)."
        )
    if pred.ndim == 0:
        raise ValueError("per_sample_mse: inputs are 0-dim; pass tensors with a leading batch dimension (B, ...).")
    diff = pred.float() - target.float()
    return diff.square().reshape(diff.shape[0], -1).mean(dim=1)


def draw_timesteps_and_noise(
    policy, shape: tuple[int, ...], timestep_min: int, timestep_max: int | None, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training timestep ``t ~ U{timestep_min..timestep_max}`` per sample, then one ``ε ~ N(0, I)`` of `shape`
    (in that order from `generator`), both on the generator's device (CPU without one); ε is float32.

    Returns:
        `(timesteps (B,) int64, noise shape float32)` with ``B = shape[0]``.

    Raises:
        ValueError: if `timestep_max` is beyond the scheduler's ``num_train_timesteps - 1`` (``None`` means that).
    """
    num_train_timesteps = policy.scheduler.config.num_train_timesteps
    t_max = num_train_timesteps - 1 if timestep_max is None else timestep_max
    if t_max >= num_train_timesteps:
        raise ValueError(f"method.timestep_max={t_max} is outside the scheduler's range 0..{num_train_timesteps - 1}; "
                         "lower it or set it to null.")
    device = generator.device if generator is not None else torch.device("cpu")
    timesteps = torch.randint(timestep_min, t_max + 1, (shape[0],), generator=generator, device=device,
                              dtype=torch.long)
    noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return timesteps, noise
