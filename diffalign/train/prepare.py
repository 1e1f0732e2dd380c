"""One run, checked and built once: `prepare_run` (``diffalign-train`` and ``train(cfg)`` from Python both go through it).

`check_run` runs every check of the config, before any model loads, exactly once: ``model.init_lora``'s settings
adopted (its file read and checked, `diffalign.lora.initial.adopt_init_lora`), every node checked (`diffalign.config.validation
.validate_train_config`, which runs each component's own checks beside its fields) and the launch
(`diffalign.runtime.distributed.check_launch`). `build_run` then builds every component exactly once, in the order the
loops always built them after seeding (so every random stream is unchanged): the method and the reference strategy
(their constructors only check and store arguments), the `Accelerator` (which seeds every RNG with ``cfg.seed``), the
policy (with ``model.init_lora``'s weights), the reference strategy's and the method's ``setup`` on the policy, the data set (preference loop) or the prompt rows (online loop), the training and
evaluation rewards and the hacking monitor. The loops (`diffalign.train.online.train`,
`diffalign.train.preference.train`) take the `PreparedRun` and wire the optimizer, LR schedule and checkpoints around
it; they build and check nothing again.

The run lock (`diffalign.runtime.runlock`) is taken once: by the Hydra callback under ``diffalign-train``, by the loop
(`run_lock_once`) for a Python caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from diffalign.config.validation import construct, validate_train_config
from diffalign.methods import ONLINE_FLOWS
from diffalign.runtime.runlock import holds, run_lock


@dataclass
class PreparedRun:
    """A checked config and its built components, handed to a training loop.

    Attributes:
        cfg (`DictConfig`): the checked config (``model.init_lora``'s settings adopted).
        online (`bool`): the method's ``data_flow`` is online (`diffalign.methods.ONLINE_FLOWS`).
        accelerator (`Accelerator`): made by `diffalign.train.common.make_accelerator` (RNGs seeded).
        method: the method object (``cfg.method``), set up on the policy.
        policy: the policy, on the accelerator's device, with the reference's and the method's adapters.
        reference: the reference strategy (``cfg.reference``), set up on the policy.
        rewards (`WeightedSum`): the training rewards; eval_rewards (`dict`): the evaluation set.
        monitor: the hacking monitor (`diffalign.evaluation.monitors.build_monitor`), or None.
        dataset: the preference data set (``cfg.data``), None for an online method.
        rows (`list[dict]`): the online loop's train prompts (``online.prompts``), None for a preference method.
        pixel_size (`tuple[int, int]`): the model's image size (height, width) in pixels (preference runs).
    """

    cfg: DictConfig
    online: bool
    accelerator: Accelerator
    method: object
    policy: object
    reference: object
    rewards: object
    eval_rewards: dict
    monitor: object
    dataset: object = None
    rows: list | None = None
    pixel_size: tuple[int, int] = (0, 0)


def is_online(cfg: DictConfig) -> bool:
    """Whether ``cfg.method`` is an online method (its class's ``data_flow`` is in `ONLINE_FLOWS`)."""
    return getattr(get_class(cfg.method._target_), "data_flow", None) in ONLINE_FLOWS


def check_run(cfg: DictConfig, overrides: Iterable[str] = (), explicit_model_keys: Iterable[str] = ()) -> None:
    """Every check of a training config, once, before any model loads (see the module docstring); changes `cfg` in
    place (``model.init_lora``'s settings adopted).

    Args:
        overrides (`Iterable[str]`): the command line's overrides (Hydra's task overrides; empty from Python).
        explicit_model_keys (`Iterable[str]`): ``model`` fields set on the command line (a conflict with
            ``model.init_lora``'s file is an error, `diffalign.lora.initial.adopt_init_lora`).

    Raises:
        ValueError / FileNotFoundError: one line naming the field and the fix.
    """
    from diffalign.lora.initial import adopt_init_lora, check_resume_lora
    from diffalign.runtime.distributed import check_launch

    overrides = list(overrides)
    adopt_init_lora(cfg, explicit=explicit_model_keys)  # its rank, alpha and targets, then checked with the rest
    validate_train_config(cfg, overrides=overrides)
    check_resume_lora(cfg)  # a resume without the run's own recipe / model: named before the model loads
    check_launch(cfg)  # a DeepSpeed launch, and what FSDP does not run (diffalign/runtime/distributed.py)


def build_run(cfg: DictConfig) -> PreparedRun:
    """Builds every component of a checked config exactly once (`check_run` first; see the module docstring).

    Raises:
        ValueError: what only the built objects can tell (e.g. a data set smaller than its files promised, FSDP's
            limits on the built reference and method, `diffalign.runtime.distributed.check_fsdp_run`).
    """
    from diffalign.evaluation.monitors import build_monitor
    from diffalign.lora.initial import build_policy
    from diffalign.runtime.distributed import check_fsdp_run
    from diffalign.train.common import build_reward_sets, make_accelerator
    from diffalign.world.prompts import load_prompts

    online = is_online(cfg)
    # (the constructors of methods and reference strategies only check and store their arguments: built first, so
    # that a bad argument is one line before any model loads)
    method = construct(cfg.method, "method")
    reference = construct(cfg.reference, "reference")
    gradient_accumulation_steps = 1 if online else cfg.trainer.gradient_accumulation_steps
    accelerator = make_accelerator(cfg, gradient_accumulation_steps=gradient_accumulation_steps)
    policy = build_policy(cfg, log=accelerator.print)  # with model.init_lora's weights (diffalign/lora/initial.py)
    policy.to(accelerator.device)
    reference.setup(policy)  # the reference adapter (if any) before the optimizer collects the trainable parameters
    method.setup(policy)  # e.g. θ⁻'s adapter, for the same reason
    check_fsdp_run(accelerator, reference, method)  # what FSDP does not run (diffalign.runtime.distributed)
    dataset, pixel_size = None, (0, 0)
    if not online:
        latent_h, latent_w = policy.latent_shape[1:]
        pixel_size = (latent_h * policy.vae_scale_factor, latent_w * policy.vae_scale_factor)
        data_kwargs = {}
        if "resolution" in cfg.data and cfg.data.resolution is None:
            if pixel_size[0] != pixel_size[1]:
                raise ValueError(f"the model's images are {pixel_size[0]}x{pixel_size[1]} px; set data.resolution")
            data_kwargs["resolution"] = pixel_size[0]
        dataset = instantiate(cfg.data, **data_kwargs)
    # every reward call is checked (RewardError names reward, step, batch, prompt; nothing becomes 0 silently)
    rewards, eval_rewards = build_reward_sets(cfg)
    monitor = build_monitor(cfg.get("monitor"), eval_rewards, samples_dir=Path(cfg.output_dir) / "logs" / "samples")
    rows = load_prompts(cfg.online.prompts, field="online.prompts") if online else None
    return PreparedRun(cfg, online, accelerator, method, policy, reference, rewards, eval_rewards, monitor, dataset,
                       rows, pixel_size)


def prepare_run(cfg: DictConfig, overrides: Iterable[str] = (), explicit_model_keys: Iterable[str] = ()
                ) -> PreparedRun:
    """`check_run`, then `build_run`: the run a training loop takes (``train(prepare_run(cfg))``).

    Raises:
        ValueError / FileNotFoundError: from the checks (one line naming the field and the fix), before any model
            loads.
    """
    check_run(cfg, overrides, explicit_model_keys)
    return build_run(cfg)


@contextlib.contextmanager
def run_lock_once(output_dir, program: str = "diffalign-train") -> Iterator[None]:
    """The run lock of `output_dir` for the life of a loop, taken here only when this process does not hold it already
    (``diffalign-train``'s Hydra callback took it before Hydra wrote ``.hydra/``): one lock per run."""
    if holds(output_dir):
        yield
        return
    with run_lock(output_dir, program):
        yield
