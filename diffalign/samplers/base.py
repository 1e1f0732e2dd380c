"""The sampler contract: one `Sampler` object per ``sampler`` config node, built once and used by every caller that
samples (online rollouts, evaluation, reward-hacking monitors, on-policy data, SePPO's reference samples).

A sampler is one file and one YAML option, with no central edit (as a method is: `diffalign.methods`). The file holds
its step function and a dataclass decorated with `register_sampler`::

    @register_sampler
    @dataclass
    class CPSSampler(FlowSampler):
        name: str = "cps_sde"                 # the option name (``sampler=cps_sde``), also `Trajectory.sampler`
        num_inference_steps: int = 10
        guidance_scale: float = 4.5
        noise_level: float = 0.8              # its own noise parameter
        noise_field: ClassVar[str] = "noise_level"

        def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
            return cps_step(...)

and ``configs/sampler/cps_sde.yaml`` extends its schema (``/schema/sampler/cps_sde@_here_``). The dataclass is at the
same time the Hydra schema of the option (so Hydra type-checks ``sampler.noise_level=high``) and the object the loops
sample with: `build_sampler` turns a composed node into an instance, and the instance's ``__post_init__`` checks the
ranges (one `ConfigError` line naming the field and the fix, before any model loads;
`diffalign.samplers.checks.check_sampler_config`).

What a sampler declares:

- ``name`` (`str`): the option name; ``model_family`` (`str`): the models it steps, "eps" (ε/v-prediction, a
  `DDIMScheduler`), "flow" (rectified flow, a `FlowMatchEulerDiscreteScheduler`) or "any";
- ``num_inference_steps`` (`int` ≥ 1), ``guidance_scale`` (`float` ≥ 1, classifier-free guidance w; 1 turns it off);
- ``noise_field`` (class attribute): the name of its noise parameter (``"eta"`` for DDIM, ``"noise_level"`` for the
  flow SDEs, None for an ODE solver); `Sampler.noise` reads it;
- ``log_probs`` (class attribute): whether its trajectories store per-step log-probabilities (policy-gradient
  methods need them);
- ``sample(policy, prompts, *, generator, latents, ...) -> Trajectory``: one batch. The default is the unrolled loop
  of `Sampler.sample` (DDPO, arXiv:2305.13301, §4.3), which calls the sampler's ``step``; an ODE solver overrides
  ``sample`` instead;
- ``for_policy(policy)``: the sampler that steps a given policy (itself; ``sampler=ode`` picks its family's
  deterministic sampler, `diffalign.samplers.ode.PipelineODESampler`);
- ``at_epoch(epoch)``: the sampler for an online epoch (itself; MixGRPO's window moves with the epoch);
- ``for_trajectory(trajectory)`` (class method): the sampler that re-scores a stored trajectory
  (`diffalign.samplers.rollout.recompute_step`), rebuilt from ``trajectory.sampler``, its noise and its schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from diffalign.config.checks import ConfigError, choice, integer, number
from diffalign.config.schemas import config_schema
from diffalign.models.base import inference_lora
from diffalign.types import PromptEmbeds, Trajectory

MODEL_FAMILIES = ("eps", "flow", "any")
SAMPLERS: dict[str, type[Sampler]] = {}
"""Every registered sampler class by option name (filled by `register_sampler` as the sampler files are imported)."""


def randn_tensor(shape, *, generator=None, device=None, dtype=None) -> torch.Tensor:
    """Standard normal noise of `shape`, drawn by diffusers' `randn_tensor` (as its pipelines draw latents and
    schedulers their step noise: per-sample generators, CPU draw for a CPU generator). diffusers is imported on the
    first draw, not with the sampler files: the config checks import these (sampler schemas, range checks), and
    importing ``diffusers.utils`` costs seconds before any config error could be reported
    (docs/results/performance.md#start-up)."""
    from diffusers.utils.torch_utils import randn_tensor as draw

    return draw(shape, generator=generator, device=device, dtype=dtype)


def register_sampler(cls: type) -> type:
    """Class decorator (above ``@dataclass``): registers a `Sampler` dataclass under its ``name`` default, in
    `SAMPLERS` and as the Hydra schema ``schema/sampler/<name>`` (`diffalign.schemas.config_schema`).

    Raises:
        TypeError: if `cls` is not a `Sampler` dataclass.
        ValueError: if another class already holds the name.
    """
    if not (isinstance(cls, type) and issubclass(cls, Sampler) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_sampler: {getattr(cls, '__qualname__', cls)} must be a @dataclass subclass of "
                        "diffalign.samplers.base.Sampler (decorate it with @dataclass below @register_sampler)")
    name = cls.name
    held = SAMPLERS.get(name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"sampler {name!r} is registered by both {held.__module__}.{held.__qualname__} and "
                         f"{cls.__module__}.{cls.__qualname__}; rename one")
    SAMPLERS[name] = cls
    return config_schema("sampler", name)(cls)


def sampler_names() -> tuple[str, ...]:
    """The registered option names (the built-in samplers imported first)."""
    import diffalign.samplers  # noqa: F401 (imports the built-in sampler files, which register themselves)

    return tuple(SAMPLERS)


def sampler_class(name: str, select: str = "sampler") -> type[Sampler]:
    """The registered class of option `name`.

    Args:
        select (`str`): the override that selects the node's option, named in the error (``sampler``,
            ``sampler@eval.sampler``).

    Raises:
        ConfigError: for an unknown name, listing the registered ones.
    """
    names = sampler_names()
    if name not in SAMPLERS:
        raise ConfigError(f"name={name!r} must be one of ({', '.join(repr(n) for n in names)}); select the sampler "
                          f"with {select}=<option>")
    return SAMPLERS[name]


def build_sampler(node: Any, where: str = "sampler") -> Sampler:
    """The `Sampler` of a config node (a composed ``sampler``-group node, a dict, or a `Sampler`, returned as is).

    Args:
        node: the node; its ``name`` selects the class, its other keys are the class's fields.
        where (`str`): the node's path in the run config, prefixed to error messages (e.g. ``eval.sampler``).

    Raises:
        ConfigError: naming ``<where>.<field>``, the value and the fix (an unknown name or field, a value out of
            range).
    """
    if isinstance(node, Sampler):
        return node
    select = "sampler" if where == "sampler" else f"sampler@{where}"  # (a nested node: Hydra's group@package)
    if node is None:
        raise ConfigError(f"{where} is not set; select a sampler with {select}=<option> (e.g. ode, ddim, flow_sde)")
    from omegaconf import DictConfig, OmegaConf

    values = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node)
    try:
        cls = sampler_class(values.get("name"), select)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a field of sampler={cls.name} (fields: {', '.join(sorted(fields))})")
        return cls(**values)
    except ConfigError as err:
        raise ConfigError(f"{where}.{err}") from None


class StepOutput(Protocol):
    """What a sampler's ``step`` returns (`diffalign.samplers.ddim_logprob.DDIMStepOutput`,
    `diffalign.samplers.flow_sde.FlowStepOutput`): the next latent `(B, ...)`, the transition's mean `(B, ...)` (the
    gradient path to the model), its std (0-dim or broadcastable) and the log-prob of the next latent `(B,)` (or
    `(B, *grid)` for ``reduction="per_position"``), 0 where the std is 0."""

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


@dataclass
class Schedule:
    """What a sampler's ``step`` reads besides the sample: the scheduler (DDIM's alphas), the `(K,)` timesteps, and
    the `(K+1,)` float32 sigmas of a flow model (None for DDIM); for a re-scored trajectory, its `(K,)` `trainable`
    mask (None while sampling)."""

    scheduler: Any
    timesteps: torch.Tensor
    sigmas: torch.Tensor | None = None
    trainable: torch.Tensor | None = None


@dataclass
class Sampler:
    """A sampling configuration and the loop that runs it (module docstring). Subclasses register with
    `register_sampler` and define ``step`` (or override ``sample``).

    Attributes:
        name (`str`): the option name.
        model_family (`str`): "eps", "flow" or "any" (`MODEL_FAMILIES`).
        num_inference_steps (`int`): K ≥ 1 steps.
        guidance_scale (`float`): classifier-free guidance w ≥ 1 (1 disables it).
    """

    name: str = ""
    model_family: str = "any"
    num_inference_steps: int = 20
    guidance_scale: float = 4.0

    noise_field: ClassVar[str | None] = None
    log_probs: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Range checks of the fields; a subclass adds its own after ``super().check()``.

        Raises:
            ConfigError: ``<field> must be ...`` (`build_sampler` prefixes the node's path).
        """
        values = vars(self)
        choice(values, "model_family", "", MODEL_FAMILIES)
        integer(values, "num_inference_steps", "", ge=1)
        number(values, "guidance_scale", "", ge=1, hint="classifier-free guidance w >= 1; 1 turns guidance off")

    @property
    def noise(self) -> float:
        """The value of the noise parameter (``eta`` / ``noise_level``); 0 for an ODE solver."""
        return float(getattr(self, self.noise_field)) if self.noise_field else 0.0

    @property
    def stochastic(self) -> bool:
        """Its trajectories carry per-step log-probabilities: a sampler with ``log_probs`` and a noise > 0."""
        return self.log_probs and self.noise > 0

    def describe(self) -> str:
        """A short label for logs and errors, e.g. ``flow_sde noise_level=0.7``."""
        return f"{self.name} {self.noise_field}={getattr(self, self.noise_field)}" if self.noise_field else self.name

    def for_policy(self, policy) -> Sampler:
        """The sampler that steps `policy` (itself; ``sampler=ode`` picks its family's deterministic sampler)."""
        return self

    def at_epoch(self, epoch: int) -> Sampler:
        """The sampler of online epoch `epoch` (0-based); itself unless its settings move with training."""
        return self

    @classmethod
    def for_trajectory(cls, trajectory: Trajectory) -> Sampler:
        """The sampler that produced `trajectory`, for re-scoring its stored transitions: its noise, steps and
        guidance (a sampler whose step depends on more overrides this)."""
        values = {"num_inference_steps": len(trajectory.timesteps), "guidance_scale": trajectory.guidance_scale}
        if cls.noise_field:
            values[cls.noise_field] = trajectory.noise
        return cls(**values)

    def fits(self, policy) -> None:
        """Raises ValueError when the policy is not of the sampler's model family (naming the samplers that fit)."""
        if self.model_family == "any":
            return
        flow = policy.prediction_type == "flow"
        if self.model_family == "flow" and not flow:
            raise ValueError(f"sampler={self.name} steps rectified-flow models, but the policy is an eps/v model; use "
                             "sampler=ddim (sampler.eta > 0) for stochastic rollouts, sampler=dpm_ode for deterministic "
                             "ones")
        if self.model_family == "eps" and flow:
            raise ValueError(f"sampler={self.name} steps eps/v models, but the policy is a flow model; use "
                             "sampler=flow_sde (or dance_sde, cps_sde, window_sde) for stochastic rollouts, "
                             "sampler=dpm_ode / euler_ode for deterministic ones")

    # the unrolled loop -------------------------------------------------------------------------------------------

    def schedule(self, policy) -> Schedule:
        """Sets the policy scheduler's timesteps for `num_inference_steps` and returns the `Schedule`."""
        raise NotImplementedError(f"sampler {self.name} defines neither `schedule`/`step` nor `sample`")

    def stored_schedule(self, policy, trajectory: Trajectory) -> Schedule:
        """The `Schedule` of a stored trajectory on the trajectory's device (for re-scoring)."""
        raise NotImplementedError(f"sampler {self.name} cannot re-score trajectories")

    def step(self, schedule: Schedule, k: int, model_output: torch.Tensor, sample: torch.Tensor, *,
             generator: torch.Generator | list[torch.Generator] | None = None,
             prev_sample: torch.Tensor | None = None, reduction: str = "mean") -> StepOutput:
        """Step `k` of the schedule: draws (or scores the given `prev_sample`) x_{k+1} from `sample` x_k and the
        guided model output (a `StepOutput`)."""
        raise NotImplementedError(f"sampler {self.name} defines no `step`")

    def sample(
        self,
        policy,
        prompts: list[str],
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        negative_prompts: list[str] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        decode: bool = True,
        reduction: str = "mean",
        callback: Callable[[dict[str, Any]], None] | None = None,
        enable_grad: bool = False,
        fuse_lora: bool = False,
    ) -> Trajectory:
        """Samples `len(prompts)` images and records the trajectory: each step k draws x_{k+1} with ``step`` and
        stores its log-probability; the model output is guided with `guidance_scale` exactly as a policy-gradient
        objective recomputes it (`diffalign.samplers.rollout.recompute_log_probs`). Runs under `torch.no_grad()`
        unless `enable_grad`.

        Args:
            policy (`DiffusionPolicy`): a policy of the sampler's family (`fits`).
            prompts (`list[str]`): `B` prompts, one per sample.
            generator (`torch.Generator` or list of `B`, *optional*): noise for the initial latents and every step;
                with one generator per image, image k depends only on generator k.
            latents (`torch.Tensor`, *optional*): `(B, C, h, w)` initial noise (times the scheduler's
                `init_noise_sigma`, as the pipelines do); drawn with `randn_tensor` when not given.
            negative_prompts (`list[str]`, *optional*): `B` negative prompts or one for all; default "".
            prompt_embeds (`PromptEmbeds`, *optional*): precomputed embeddings, `B` rows (with negatives if w > 1).
            decode (`bool`): decode the final latents to images.
            reduction (`str`): log-prob reduction over latent elements, "mean" or "sum", or "per_position" (sum over
                channels; `log_probs` is then `(B, K, *grid)`, ViPO).
            callback (*optional*): called after every step with ``{"i", "t", "x", "x_next", "model_output", "mean",
                "std", "log_prob"}``.
            enable_grad (`bool`): keep the autograd graph through the whole loop.
            fuse_lora (`bool`): without gradients an all-zero LoRA adapter is always skipped (bit-for-bit the same
                samples); with `fuse_lora` a non-zero one is fused into the weights for the rollout and restored
                afterwards (`diffalign.models.base.inference_lora`; for evaluation and data, not policy gradients).

        Returns:
            `Trajectory` with float32 `latents` `(B, K+1, C, h, w)`, `timesteps` `(K,)`, `log_probs` `(B, K)`,
            `trainable` `(K,)` (False where the step std is 0), `images` `(B, 3, H, W)` in [0, 1] or None,
            `sampler` = `name`, `noise` = `noise`.

        Raises:
            ValueError: for a generator list, `latents` or `prompt_embeds` that does not match the batch, or a policy
                of the other family.
        """
        shape = self._check_batch(policy, prompts, generator, latents, prompt_embeds)
        denoiser = getattr(policy, "denoiser", None)
        lora_context = (inference_lora(denoiser, fuse=fuse_lora) if denoiser is not None and not enable_grad
                        else contextlib.nullcontext())
        with torch.set_grad_enabled(enable_grad), lora_context:
            # 1. encode the prompts (negatives only with guidance)
            if prompt_embeds is None:
                prompt_embeds = policy.encode_prompts(prompts, negative_prompts,
                                                      do_classifier_free_guidance=self.guidance_scale > 1)
            # 2. timesteps, e.g. [981, 961, ..., 1] for 50 SD steps
            schedule = self.schedule(policy)
            # 3. initial noise, drawn as `StableDiffusionPipeline.prepare_latents` draws it
            device = policy.device
            if latents is None:
                latents = randn_tensor(shape, generator=generator, device=device, dtype=policy.dtype)
            latents = (latents.to(device) * getattr(schedule.scheduler, "init_noise_sigma", 1.0)).float()
            # 4. denoise, recording x_k, log π(x_{k+1} | x_k) and the step std
            all_latents, log_probs, stds = [latents], [], []
            for i, t in enumerate(schedule.timesteps):
                model_output = policy.predict(latents, t, prompt_embeds, self.guidance_scale)
                step = self.step(schedule, i, model_output, latents, generator=generator, reduction=reduction)
                if callback is not None:
                    callback({"i": i, "t": t, "x": latents, "x_next": step.prev_sample, "model_output": model_output,
                              "mean": step.mean, "std": step.std, "log_prob": step.log_prob})
                latents = step.prev_sample
                all_latents.append(latents)
                log_probs.append(step.log_prob)
                stds.append(torch.as_tensor(step.std).reshape(-1)[0])
            # 5. decode
            images = policy.decode(latents) if decode else None
        sigmas = schedule.sigmas
        return Trajectory(
            latents=torch.stack(all_latents, dim=1), timesteps=schedule.timesteps.clone(),
            log_probs=torch.stack(log_probs, dim=1), trainable=torch.stack(stds) > 0, prompt_embeds=prompt_embeds,
            images=images, prompts=list(prompts), guidance_scale=self.guidance_scale, noise=self.noise,
            sigmas=None if sigmas is None else sigmas.cpu(), sampler=self.name,
        )

    def _check_batch(self, policy, prompts, generator, latents, prompt_embeds) -> tuple[int, ...]:
        """`sample`'s argument checks; returns the latents' shape `(B, C, h, w)`."""
        batch_size = len(prompts)
        if isinstance(generator, list) and len(generator) != batch_size:
            raise ValueError(f"Got a list of {len(generator)} generators for {batch_size} prompts; pass one generator "
                             f"per image ({batch_size}) or a single generator.")
        if prompt_embeds is not None and len(prompt_embeds) != batch_size:
            raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows for {batch_size} prompts; pass one per "
                             "prompt.")
        self.fits(policy)
        shape = (batch_size, *policy.latent_shape)
        if latents is not None and tuple(latents.shape) != shape:
            raise ValueError(f"`latents` must have shape {shape}, got {tuple(latents.shape)}.")
        return shape


@dataclass
class FlowSampler(Sampler):
    """Base of the flow-model step samplers: the schedule is the policy's `FlowMatchEulerDiscreteScheduler` sigmas
    (σ_0 = 1 … σ_K = 0, with the model's shift), timesteps 1000 σ_k."""

    model_family: str = "flow"

    def schedule(self, policy) -> Schedule:
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = policy.scheduler
        if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            raise TypeError(f"sampler={self.name} steps with the flow sigmas; the policy's scheduler is a "
                            f"{type(scheduler).__name__}")
        scheduler.set_timesteps(self.num_inference_steps, device=policy.device)
        return Schedule(scheduler, scheduler.timesteps, scheduler.sigmas.float())

    def stored_schedule(self, policy, trajectory: Trajectory) -> Schedule:
        device = trajectory.latents.device
        return Schedule(policy.scheduler, trajectory.timesteps.to(device), trajectory.sigmas.to(device),
                        trajectory.trainable)
