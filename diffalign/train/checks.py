"""The training loops' own settings, checked before any work: the ``trainer`` node (both loops) and the ``online`` node
(the online loop), with the options a loop would ignore refused rather than dropped.

`diffalign.config.validation.validate_train_config` calls `check_trainer_config` and, for online methods,
`check_online_config`; every error names the field and the fix (`diffalign.config.checks.ConfigError`).
"""

from __future__ import annotations

import numbers

from omegaconf import DictConfig, ListConfig

from diffalign.config.checks import (
    ConfigError,
    boolean,
    choice,
    integer,
    node_check,
    number,
    target_attribute,
    text,
)
from diffalign.world.prompts import load_prompts

LR_SCHEDULERS = ("constant_with_warmup", "cosine")
"""The LR schedules `diffalign.train.common.build_lr_scheduler` builds (both with a linear warmup)."""
MIXED_PRECISION = ("no", "fp16", "bf16")
ADVANTAGE_STDS = ("group", "global", "none")
SPLITS = ("groups", "members")
ONLINE_IGNORED_TRAINER_KEYS = {
    "max_steps": "the online loop runs online.num_epochs epochs of online.updates_per_epoch optimizer steps; set "
                 "online.num_epochs",
    "checkpointing_steps": "the online loop checkpoints every online.checkpointing_epochs epochs; set that",
    "cache_latents": "the online loop samples its own latents; nothing is cached",
    "warnings_every": "the online loop reports its repeating warnings once per epoch",
}
"""``trainer`` keys the online loop does not read, with what to set instead (refused when set on the command line)."""


def _trackers() -> list[str]:
    """The experiment trackers accelerate can use here (their packages are installed)."""
    from accelerate.tracking import get_available_trackers

    return [str(t) for t in get_available_trackers()]


def check_optimizer(node, name: str) -> None:
    """Checks an optimizer node (``trainer.optimizer``) before any work: it names an importable ``_target_``, every
    other key is an argument of that class (unless it takes ``**kwargs``), and the usual AdamW-style numbers are in range
    where present (``lr`` > 0, ``weight_decay`` >= 0, ``eps`` > 0, ``betas`` two numbers in [0, 1)).

    Raises:
        ConfigError: naming the field and the fix.
    """
    import importlib
    import inspect

    if not isinstance(node, DictConfig) or not node.get("_target_"):
        raise ConfigError(f"{name} must be a node with _target_ naming the optimizer class, got {node!r}; e.g. "
                          f"{name}._target_=torch.optim.AdamW")
    target = str(node._target_)
    module, _, attribute = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
        parameters = inspect.signature(cls).parameters
    except Exception as err:  # noqa: BLE001 - any failure to import the target is the same config error
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{name}._target_={target} cannot be imported ({reason}); name a class such as "
                          f"torch.optim.AdamW, or install its package") from None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        arguments = [k for k in parameters if k != "params"]
        for key in node:
            if not str(key).startswith("_") and key not in parameters:
                raise ConfigError(f"{name}.{key} is not an argument of {target}; drop it with ~{name}.{key} (its "
                                  f"arguments: {', '.join(arguments)})")
    number(node, "lr", name, gt=0)
    number(node, "weight_decay", name, ge=0)
    number(node, "eps", name, gt=0)
    if "betas" in node:
        betas = node.betas
        if (not isinstance(betas, ListConfig) or len(betas) != 2
                or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)):
            raise ConfigError(f"{name}.betas must be two numbers in [0, 1), got {betas}; e.g. {name}.betas=[0.9,0.999]")


@node_check("trainer")
def check_trainer_config(cfg, *, online: bool) -> None:
    """Checks the ``trainer`` node: sizes and steps are integers in range, the optimizer's numbers, the LR schedule
    and mixed precision are known names, ``max_grad_norm`` is positive or null, ``keep_last`` is -1 or >= 1, the
    tracker's package is installed. For an online run (`online`), ``gradient_accumulation_steps`` must be 1: the
    online loop accumulates the micro-batches of an update itself (``online.updates_per_epoch`` sets the updates).

    Raises:
        ConfigError: naming the field and the fix.
    """
    t, p = cfg.trainer, "trainer"
    integer(t, "max_steps", p, ge=1)
    integer(t, "batch_size", p, ge=1)
    integer(t, "gradient_accumulation_steps", p, ge=1)
    check_optimizer(t.get("optimizer"), "trainer.optimizer")
    choice(t, "lr_scheduler", p, LR_SCHEDULERS)
    integer(t, "lr_warmup_steps", p, ge=0)
    if t.get("max_grad_norm") is not None and t.max_grad_norm == 0 and not isinstance(t.max_grad_norm, bool):
        # torch's clip_grad_norm_ with max_norm 0 scales every gradient to 0 (the diffusers scripts clip
        # unconditionally, so 0 trains nothing there too); transformers' Trainer reads 0 as "no clipping". Refuse.
        raise ConfigError("trainer.max_grad_norm=0 would scale every gradient to zero (torch.nn.utils.clip_grad_norm_"
                          "), so nothing would train; pass trainer.max_grad_norm=null to turn clipping off, or a "
                          "positive norm such as 1.0")
    number(t, "max_grad_norm", p, gt=0, nullable=True, hint="null turns clipping off")
    choice(t, "mixed_precision", p, MIXED_PRECISION)
    if "log_with" in t and t.log_with not in (None, "none"):
        choice(t, "log_with", p, ("tensorboard", "wandb", "trackio", "aim", "comet_ml", "mlflow", "clearml",
                                  "dvclive", "swanlab", "all", "none"), nullable=True)
        if t.log_with != "all" and t.log_with not in _trackers():
            raise ConfigError(f"trainer.log_with={t.log_with} but its package is not installed here (accelerate would "
                              f"log nothing); pip install {t.log_with}, or pass trainer.log_with=none (installed "
                              f"trackers: {_trackers() or 'none'})")
    integer(t, "warnings_every", p, ge=1, hint="optimizer steps between two summaries of the repeating warnings")
    integer(t, "checkpointing_steps", p, ge=1, nullable=True, hint="null: only the final checkpoint")
    integer(t, "keep_last", p, ge=-1, hint="-1 keeps every checkpoint, N >= 1 the newest N")
    if "keep_last" in t and t.keep_last == 0:
        raise ConfigError("trainer.keep_last=0 would delete every checkpoint, the one just written included; pass "
                          "trainer.keep_last=-1 to keep all, or N >= 1 to keep the newest N")
    boolean(t, "cpu", p)
    integer(t, "max_consecutive_nonfinite", p, ge=1,
            hint="the non-finite updates skipped in a row before the run stops with a checkpoint")
    boolean(t, "cache_latents", p)
    if not online and isinstance(t.get("max_steps"), int):
        check_warmup(cfg, t.max_steps, f"trainer.max_steps={t.max_steps}")
    if online and t.get("gradient_accumulation_steps", 1) != 1:
        raise ConfigError(f"trainer.gradient_accumulation_steps={t.gradient_accumulation_steps} is not used by the "
                          "online loop: an optimizer update there already accumulates the gradients of all its "
                          "micro-batches (the epoch's rows / online.updates_per_epoch rows, in micro-batches of "
                          "trainer.batch_size), and the processes synchronise once per update. Set the number of "
                          "optimizer steps per epoch with online.updates_per_epoch and keep "
                          "trainer.gradient_accumulation_steps=1")


@node_check("overrides")
def check_ignored_overrides(overrides: list[str], *, online: bool) -> None:
    """Refuses command-line overrides of settings the chosen loop does not read (they would be dropped silently):
    ``trainer.max_steps`` / ``checkpointing_steps`` / ``cache_latents`` / ``warnings_every`` for an online method, ``online.*`` for a
    preference method.

    Args:
        overrides (`list[str]`): the command line's ``key=value`` overrides (Hydra's task overrides).

    Raises:
        ConfigError: naming the override and what to set instead.
    """
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if online and key.startswith("trainer.") and key.split(".", 1)[1] in ONLINE_IGNORED_TRAINER_KEYS:
            raise ConfigError(f"{override}: {ONLINE_IGNORED_TRAINER_KEYS[key.split('.', 1)[1]]} (the method is an "
                              "online one, which does not read this trainer setting)")
        if not online and key.startswith("online."):
            raise ConfigError(f"{override}: the online settings are read by the online methods only (dgpo, flow_grpo, "
                              "ddpo, vipo, diffusion_nft); this method trains on a data set (the preference loop: "
                              "trainer.max_steps optimizer steps over data=...). Drop the override")


@node_check("online")
def check_online_config(cfg, num_processes: int = 1) -> None:
    """Checks the ``online`` node of an online run: integer sizes in range, the advantage options, the split over
    `num_processes`, updates an epoch can fill, a learning-rate warmup the run reaches, a training reward of non-zero
    weight, the prompt file.

    Raises:
        ConfigError / FileNotFoundError: naming the field and the fix.
    """
    on, p = cfg.online, "online"
    for key in ("num_epochs", "groups_per_epoch", "rollout_batch_size", "updates_per_epoch", "num_inner_epochs",
                "tracker_buffer_size", "tracker_min_count"):
        integer(on, key, p, ge=1)
    integer(on, "group_size", p, ge=2, hint="group-relative advantages need at least 2 samples per prompt (DGPO and "
                                            "Flow-GRPO use 16-24)")
    integer(on, "checkpointing_epochs", p, ge=0, nullable=True, hint="0 or null: only the final checkpoint")
    boolean(on, "shared_initial_noise", p)
    boolean(on, "ema", p)
    number(on, "ema_decay", p, ge=0, lt=1, hint="the EMA's decay cap; 0.9 in Flow-GRPO's and DGPO's code")
    integer(on, "ema_update_interval", p, ge=1, hint="the EMA is updated every this many optimizer steps (8 in the code)")
    choice(on, "advantage_std", p, ADVANTAGE_STDS)
    choice(on, "advantage_std_correction", p, (0, 1),
           hint="0: population std (flow_grpo, DGPO); 1: sample std (DanceGRPO, ViPO)")
    number(on, "advantage_eps", p, gt=0, hint="flow_grpo 1e-4, ViPO 1e-8")
    number(on, "advantage_clip", p, gt=0, nullable=True)
    fuse = on.get("fuse_rollout_lora", "auto")
    if not (isinstance(fuse, bool) or fuse == "auto"):
        raise ConfigError(f"online.fuse_rollout_lora={fuse!r} must be 'auto' (fuse for rollouts without stored "
                          "log-probs), true or false")
    choice(on, "split", p, SPLITS, hint="groups: whole groups per process; members: every group spread over them")
    integer(on, "best_of_n", p, ge=2, nullable=True)
    best = on.get("best_of_n")
    if best is not None and best % 2:
        raise ConfigError(f"online.best_of_n={best} must be an even number >= 2 (n/2 best and n/2 worst per group), "
                          "or null")
    check_split(on, num_processes)
    updates = on.num_epochs * on.updates_per_epoch * on.num_inner_epochs  # (at most: DGPO makes one pass)
    check_warmup(cfg, updates, f"online.num_epochs={on.num_epochs} x online.updates_per_epoch={on.updates_per_epoch}"
                 f" x online.num_inner_epochs={on.num_inner_epochs}")
    rows = on.groups_per_epoch * (best or on.group_size) // num_processes  # this process's rows of an epoch
    steps = cfg.get("sampler", {}).get("num_inference_steps", 1)
    if on.updates_per_epoch > rows * steps:
        raise ConfigError(f"online.updates_per_epoch={on.updates_per_epoch} but an epoch gives each process "
                          f"{rows} rows x {steps} sampler steps, at most {rows * steps} units of work: the loop would "
                          f"run fewer updates than asked, without a word; lower online.updates_per_epoch (the released "
                          "code uses 1-2) or raise online.groups_per_epoch / online.group_size")
    weights = {name: (node or {}).get("weight", 1.0) for name, node in (cfg.get("reward") or {}).items()}
    if weights and all(w == 0 for w in weights.values()):
        raise ConfigError(f"every training reward has weight 0 ({', '.join(f'reward.{n}.weight=0' for n in weights)}):"
                          " every advantage would be 0 and nothing would train; give a reward a weight > 0, e.g. "
                          f"reward.{next(iter(weights))}.weight=1")
    if on.get("prompts") is None:
        raise ConfigError("online.prompts is required by this recipe (it trains on your prompts, not the tiny "
                          "world's); pass online.prompts=<prompt file: .jsonl with GenEval metadata, .txt or .csv>")
    text(on, "prompts", p)
    rows = load_prompts(on.prompts, field="online.prompts")
    for node in (cfg.get("reward") or {}).values():  # a reward that scores some prompts only (a verifier)
        check = target_attribute((node or {}).get("_target_"), "check_prompts")
        if check is not None:
            check(rows, f"online.prompts={on.prompts!r}")


def check_split(on, num_processes: int) -> None:
    """The ``online`` settings that depend on the number of processes: ``groups_per_epoch`` (``split=groups``) or
    ``group_size`` (``split=members``) divisible by them, and best-of-n only with whole groups per process.

    Raises:
        ConfigError: naming the field and the fix.
    """
    split = on.get("split", "groups")
    if split == "groups" and on.groups_per_epoch % num_processes:
        raise ConfigError(f"online.groups_per_epoch={on.groups_per_epoch} must be divisible by the {num_processes} "
                          "processes (or set online.split=members to spread every group over the processes).")
    if split == "members":
        if on.group_size % num_processes:
            raise ConfigError(f"online.split=members: online.group_size={on.group_size} must be divisible by the "
                              f"{num_processes} processes")
        if on.get("best_of_n"):
            raise ConfigError("online.best_of_n selects within whole groups; use online.split=groups with it")


def check_warmup(cfg, total_updates: int, field: str) -> None:
    """``trainer.lr_warmup_steps`` the run reaches: a warmup over ten times longer than the run's `total_updates`
    keeps the learning rate under a tenth of ``trainer.optimizer.lr`` (linear warmup, `diffalign.train.common
    .build_lr_scheduler`), so the run would barely train.

    Raises:
        ConfigError: naming the field, the run's length (`field`) and the fix.
    """
    warmup = cfg.trainer.get("lr_warmup_steps", 0)
    if isinstance(warmup, int) and warmup > 10 * total_updates:
        raise ConfigError(f"trainer.lr_warmup_steps={warmup} is far beyond the run's {total_updates} optimizer "
                          f"updates ({field}): the learning rate would stay under {total_updates / warmup:.1%} of "
                          f"trainer.optimizer.lr and the run would barely train; pass trainer.lr_warmup_steps <= "
                          f"{total_updates} (e.g. trainer.lr_warmup_steps=0)")
