"""Small numerical helpers shared by the objectives."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def per_sample_mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    r"""Per-sample denoising ("DSM") loss, docs/methods/algorithms.md#denoising-loss.

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


Generators = torch.Generator | Sequence[torch.Generator] | None


def generator_device(generator: Generators) -> torch.device:
    """The device random draws happen on: the generator's (the first one's for a list), CPU without one."""
    if isinstance(generator, (list, tuple)):
        generator = generator[0] if generator else None
    return generator.device if generator is not None else torch.device("cpu")


def _check_per_sample(generator: Generators, n: int) -> bool:
    if not isinstance(generator, (list, tuple)):
        return False
    if len(generator) != n:
        raise ValueError(f"got {len(generator)} generators for a batch of {n}; pass one torch.Generator per sample "
                         "(or a single one for the whole batch)")
    return True


def randn(shape: tuple[int, ...], generator: Generators) -> torch.Tensor:
    """``ε ~ N(0, I)`` of `shape` (float32, on `generator_device`). With a list of `shape[0]` generators, row i comes
    from generator i alone (diffusers' per-sample convention, ``randn_tensor``), so a sample's draws do not depend on
    which other samples share its batch — a batch split across processes draws what the whole batch would."""
    device = generator_device(generator)
    if _check_per_sample(generator, shape[0]):
        return torch.stack([torch.randn(shape[1:], generator=g, device=device, dtype=torch.float32)
                            for g in generator])
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)


def randint(low: int, high: int, n: int, generator: Generators) -> torch.Tensor:
    """`n` integers uniform in ``[low, high)`` (int64, on `generator_device`); per sample with a list (see `randn`)."""
    device = generator_device(generator)
    if _check_per_sample(generator, n):
        return torch.cat([torch.randint(low, high, (1,), generator=g, device=device, dtype=torch.long)
                          for g in generator])
    return torch.randint(low, high, (n,), generator=generator, device=device, dtype=torch.long)


def rand(n: int, generator: Generators) -> torch.Tensor:
    """`n` floats uniform in ``[0, 1)`` (float32 whatever torch's default dtype, as `randn`: a float64 draw consumes
    the generator differently, so DDSPO's random-condition mask would change with the default dtype; on
    `generator_device`); per sample with a list (see `randn`)."""
    device = generator_device(generator)
    if _check_per_sample(generator, n):
        return torch.cat([torch.rand(1, generator=g, device=device, dtype=torch.float32) for g in generator])
    return torch.rand(n, generator=generator, device=device, dtype=torch.float32)


def draw_timesteps_and_noise(
    policy, shape: tuple[int, ...], timestep_min: int, timestep_max: int | None, generator: Generators
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training timestep ``t ~ U{timestep_min..timestep_max}`` per sample, then one ``ε ~ N(0, I)`` of `shape`
    (in that order from `generator`), both on the generator's device (CPU without one); ε is float32.

    `generator` is one `torch.Generator` for the batch, or a list of ``shape[0]`` generators, one per sample (sample
    i's t and ε then come from generator i only; the training loops pass these, keyed by the sample's position in the
    global batch, so a run on N processes draws the same values as one process with the same global batch).

    Returns:
        `(timesteps (B,) int64, noise shape float32)` with ``B = shape[0]``.

    Raises:
        ValueError: if `timestep_max` is beyond the scheduler's ``num_train_timesteps - 1`` (``None`` means that), or a
            list of generators does not have one per sample.
    """
    num_train_timesteps = policy.scheduler.config.num_train_timesteps
    t_max = num_train_timesteps - 1 if timestep_max is None else timestep_max
    if t_max >= num_train_timesteps:
        raise ValueError(f"method.timestep_max={t_max} is outside the scheduler's range 0..{num_train_timesteps - 1}; "
                         "lower it or set it to null.")
    timesteps = randint(timestep_min, t_max + 1, shape[0], generator)
    noise = randn(shape, generator)
    return timesteps, noise


def check_timestep_range(config) -> None:
    """``method.timestep_min`` / ``method.timestep_max`` of a preference method's config (DDSPO, SePPO): the range of
    training timesteps, `timestep_max` None for the scheduler's last one.

    Raises:
        ValueError: `timestep_min` < 0, or `timestep_max` below `timestep_min` (naming the field and the fix).
    """
    if config.timestep_min < 0:
        raise ValueError(f"method.timestep_min={config.timestep_min} must be >= 0.")
    if config.timestep_max is not None and config.timestep_max < config.timestep_min:
        raise ValueError(f"method.timestep_max={config.timestep_max} is below method.timestep_min="
                         f"{config.timestep_min}; set timestep_max >= timestep_min, or null for the scheduler's "
                         "last timestep.")
