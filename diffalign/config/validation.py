"""Checks of a composed run config, done before any model is loaded (errors name the field and the fix).

`validate_train_config` orchestrates; each component checks its own fields in one place, beside them, and registers
that check by node (`diffalign.config.checks.node_check`), so this module runs it without importing the component:

==========================  ================================================================================
node                        where it is checked
==========================  ================================================================================
``seed``, ``output_dir``,   here (`check_run_settings`, `check_output_dir`, `check_resume`)
``resume``
``trainer``, ``online``     `diffalign.train.checks` (ranges, names, options a loop would ignore)
``model``                   `diffalign.models.checks` (+ the policy class's ``check_config``)
``method``                  its ``check_config`` (`diffalign.methods`); its constructor when it is built, once
                            (`diffalign.train.prepare.build_run`, through `construct`)
``sampler``                 `diffalign.samplers.checks` (ranges, and a sampler of the model's family)
``data``, ``reference``     the component class's ``check_config`` (`check_component`)
``reward.*``                `diffalign.rewards.checks` (+ the reward class's ``check_config``), modality here
``eval``, ``monitor``       here (`validate_eval_config`, `check_monitor_config`); their sampler nodes in
                            `diffalign.samplers.checks.check_sampler_node`
unknown keys, every node    here (`check_unknown_keys`)
==========================  ================================================================================

Every error is a `ValueError` (`diffalign.config.checks.ConfigError`) or `FileNotFoundError`; ``diffalign-train``
prints it as ``diffalign: error: <message>`` and exits with 1 before anything else runs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from diffalign.config.checks import (
    ConfigError,
    boolean,
    check_structured_keys,
    check_top_level_keys,
    choice,
    int_list,
    integer,
    number,
    registered_check,
    seed,
    target_attribute,
    target_modality,
    text,
)
from diffalign.methods import ONLINE_FLOWS, ONLINE_MEMBERS, PREFERENCE_FLOWS, PREFERENCE_MEMBERS, check_method
from diffalign.world.prompts import load_prompts

VIDEO_FORMATS = ("gif", "mp4")


def validate_train_config(cfg: DictConfig, overrides: list[str] | None = None) -> None:
    """Raises ValueError / FileNotFoundError for a bad training config, naming the field and the fix, before any model
    loads (the table in the module docstring says which component checks what).

    Args:
        cfg (`DictConfig`): the composed ``train`` config.
        overrides (`list[str]`, *optional*): the command line's overrides (``diffalign-train`` passes Hydra's); an
            override of a setting the chosen loop does not read is refused (`diffalign.train.checks`).

    It reads the current key names only (`diffalign.train.prepare.check_run` moves old ones first) and builds
    nothing: each component is built once, after these checks (`diffalign.train.prepare.build_run`).
    """
    online = _method_flow(cfg) in ONLINE_FLOWS  # (online methods make their own samples; `data` is unused)
    num_processes = world_size()
    check_unknown_keys(cfg)
    check_run_settings(cfg)
    registered_check("trainer")(cfg, online=online)
    if overrides:
        registered_check("overrides")(overrides, online=online)
    if online:
        registered_check("online")(cfg, num_processes=num_processes)
    flow_matching = target_attribute((cfg.get("model") or {}).get("_target_"), "flow_matching")
    registered_check("sampler")(cfg, flow_matching=flow_matching, online=online)
    check_method_config(cfg, num_processes)
    registered_check("model")(cfg)
    if not cfg.get("reward"):
        raise ConfigError("no reward selected; pass e.g. reward=[geneval_shapes] (rewards score the evaluation)")
    check_reward_nodes(cfg)
    validate_reward_modality(cfg)
    if not online:
        check_component(cfg, "data")
    check_component(cfg, "reference")
    check_monitor_config(cfg)
    if cfg.eval.enabled:
        validate_eval_config(cfg)
    else:
        boolean(cfg.eval, "enabled", "eval")
    check_resume(cfg)


def check_run_settings(cfg: DictConfig) -> None:
    """``seed`` (an integer in [0, 2**32 - 1]), ``output_dir`` (a folder that can be written) and ``resume`` (null,
    latest or a folder name)."""
    seed(cfg, "seed", "")
    text(cfg, "output_dir", "")
    check_output_dir(cfg.output_dir)
    if cfg.get("resume") is not None and not isinstance(cfg.resume, str):
        raise ConfigError(f"resume={cfg.resume!r} must be null, latest or the path of a checkpoint-<step> folder")


def check_output_dir(output_dir) -> None:
    """``output_dir`` is a folder (or can be made as one) where this process can create files: a temporary file is
    created in it (or in its nearest existing parent) and removed again, which also catches read-only mounts (where
    `os.access` says yes to root).

    Raises:
        ConfigError: ``output_dir=… cannot be written (<reason>: <path>); pass an output_dir=<folder> on a writable
            disk``.
    """
    path = Path(str(output_dir)).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fix = "pass an output_dir=<folder> on a writable disk"
    if not probe.is_dir():
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be written ({probe} is a file, not a folder); {fix}")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".diffalign-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        reason = f"{err.strerror}: {probe}"
        raise ConfigError(f"output_dir={str(output_dir)!r} cannot be written ({reason}); {fix}") from None


def check_resume(cfg: DictConfig) -> None:
    """``resume`` names a checkpoint folder (or latest), and the run will not collide with checkpoints already in
    ``output_dir``: a new run needs an output folder without checkpoints; a run resumed from a checkpoint at step s
    needs one without checkpoints after s (``checkpoint-<step>`` folders are never overwritten, so it would stop at
    the first of them).

    Raises:
        FileNotFoundError: ``resume=<folder>`` is not a checkpoint folder.
        ConfigError: the output folder holds checkpoints the run would collide with (the message names the fix).
    """
    from diffalign.runtime.checkpoint import check_resume_target, latest_checkpoint

    resume = cfg.get("resume")
    output_dir = Path(str(cfg.output_dir))
    if resume == "latest" and "${launch_time:" in str(OmegaConf.to_container(cfg, resolve=False).get("output_dir")):
        # (the default output_dir, runs/train-<time>: a new folder each time, so there is never anything to continue)
        raise ConfigError(f"resume=latest continues the run in output_dir, but output_dir is the default, a new folder "
                          f"({output_dir}); pass output_dir=<the run's folder> resume=latest")
    if resume not in (None, "latest"):
        check_resume_target(output_dir, resume)
    if resume is None and latest_checkpoint(output_dir) is not None:
        raise ConfigError(f"output_dir={str(output_dir)!r} already holds checkpoints; pass resume=latest to continue "
                          "that run, or choose a new output_dir")


def construct(node, group: str):
    """Builds the component of `node` (``cfg.<group>``) with Hydra's ``instantiate`` so its constructor checks its
    arguments before any model loads; the constructor's `ValueError` / `TypeError` comes out as a `ConfigError` with
    its own message (not Hydra's "Error in call to target"). Only for components whose constructor is cheap and has no
    side effects (methods and reference strategies; a method's is, by the contract of `diffalign.methods`).

    Returns:
        The built object, or None when `node` has no ``_target_``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if not node or "_target_" not in node:
        return None
    try:
        return instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, (ValueError, TypeError)):
            raise ConfigError(f"{group}: {cause}" if not str(cause).startswith(f"{group}.") else str(cause)) from None
        raise


def check_method_config(cfg: DictConfig, num_processes: int | None = None) -> None:
    """The method's contract (`diffalign.methods.check_method`: a data flow a loop runs, every member) and its own
    ``check_config(cfg, num_processes)``; its constructor's argument checks run when it is built, once, before any
    model loads (`diffalign.train.prepare.build_run`, through `construct`).

    Raises:
        ValueError: naming the field and the fix.
    """
    method = cfg.get("method") or {}
    if "_target_" not in method:
        return
    try:
        cls = get_class(method._target_)
    except (ImportError, AttributeError, ValueError):
        return  # (instantiate reports an unimportable target with its own message)
    flow = getattr(cls, "data_flow", None)
    if flow in ONLINE_FLOWS:
        check_method(cls, method._target_, ONLINE_FLOWS, ONLINE_MEMBERS, "online")
    else:
        check_method(cls, method._target_, PREFERENCE_FLOWS, PREFERENCE_MEMBERS, "preference")
    cls.check_config(cfg, num_processes)


def world_size() -> int:
    """The number of processes of this launch (``WORLD_SIZE``, set by ``accelerate launch`` and ``torchrun``; 1
    otherwise): what ``Accelerator().num_processes`` will be, known before anything is built."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_unknown_keys(cfg: DictConfig) -> None:
    """Every node of the run config refuses a key it does not have, naming the closest real one: top-level keys
    (``+output=...``, ``+accelerate=fsdp``; `diffalign.config.checks.check_top_level_keys`), the structured nodes
    (`diffalign.config.checks.check_structured_keys`) and the plain ones whose component registers a key check
    (``monitor``: `diffalign.evaluation.monitors.check_monitor_keys`).

    Raises:
        ConfigError: naming the key and the fix.
    """
    check_top_level_keys(cfg, train_config_keys())
    check_structured_keys(cfg)
    if "monitor" in cfg:
        registered_check("monitor_keys")(cfg.monitor)  # (diffalign.evaluation.monitors.check_monitor_keys)


def train_config_keys(name: str = "train") -> set[str]:
    """The top-level keys of a command's primary config (``train.yaml`` for ``diffalign-train``, ``evaluate.yaml`` for
    ``diffalign-eval``): its own keys and its config groups."""
    from diffalign.config.compose import CONFIG_DIR

    primary = OmegaConf.load(Path(CONFIG_DIR) / f"{name}.yaml")
    groups = set()
    for entry in primary.get("defaults") or []:
        if isinstance(entry, DictConfig):
            groups.update(str(k).split("@")[0].lstrip("/") for k in entry)
    return {str(k) for k in primary if k not in ("defaults", "hydra")} | groups


def check_reward_nodes(cfg: DictConfig) -> None:
    """Every selected reward's node, training (``reward.<name>``) and evaluation (``eval_reward.<name>``)
    (`diffalign.rewards.checks.check_reward_config`)."""
    check_reward_config = registered_check("reward")
    for field in ("reward", "eval_reward"):
        for name, node in (cfg.get(field) or {}).items():
            check_reward_config(node, f"{field}.{name}")


def check_monitor_config(cfg: DictConfig) -> None:
    """The reward-hacking monitors' node (``monitor``): ranges, names, prompts, rewards of the evaluation set."""
    monitor = cfg.get("monitor") or OmegaConf.create({})
    p = "monitor"
    integer(monitor, "every", p, ge=0, hint="0 turns the monitors off")
    if not monitor.get("every", 0):
        return
    integer(monitor, "num_prompts", p, ge=1)
    int_list(monitor, "seeds", p, ge=0, unique=True)
    boolean(monitor, "diversity", p)
    text(monitor, "diversity_model", p)
    check_sampler_node(cfg, monitor.get("sampler"), "monitor.sampler")
    integer(monitor, "batch_size", p, ge=1)
    boolean(monitor, "save_samples", p)
    choice(monitor, "video_format", p, VIDEO_FORMATS)
    eval_set = sorted(cfg.get("eval_reward") or cfg.reward)
    unknown = [n for n in (monitor.get("rewards") or []) if n not in eval_set]
    if unknown:
        raise ValueError(f"monitor.rewards: {unknown} not in the evaluation reward set {eval_set}; add them with "
                         "eval_reward=[...]")
    if monitor.get("diversity", True) and len(monitor.get("seeds") or []) < 2:
        raise ValueError(f"monitor.seeds={list(monitor.get('seeds') or [])}: diversity needs >= 2 seeds per prompt; "
                         "pass e.g. monitor.seeds=[0,1,2,3] or monitor.diversity=false")
    load_prompts(monitor.get("prompts", "heldout"), field="monitor.prompts")


def check_sampler_node(cfg: DictConfig, node, where: str) -> None:
    """The sampler node `node` at `where` (``eval.sampler``, ``monitor.sampler``): its fields, and a sampler of the
    model's family (`diffalign.samplers.checks.check_sampler_node`)."""
    target = (cfg.get("model") or {}).get("_target_")
    registered_check("sampler_node")(node, where, flow_matching=target_attribute(target, "flow_matching"),
                                     model=target)


def check_component(cfg: DictConfig, group: str) -> None:
    """Runs the ``check_config(cfg)`` classmethod of what ``cfg.<group>._target_`` builds, when it has one: a
    component checks its own fields (e.g. a data set's files, `diffalign.reference.checkpoint.CheckpointReference`'s
    folder)."""
    check = target_attribute((cfg.get(group) or {}).get("_target_"), "check_config")
    if check is not None:
        check(cfg)


def _method_flow(cfg: DictConfig) -> str | None:
    """The method class's ``data_flow`` (e.g. "pairs", "online_groups"); None for an unknown target, which Hydra's
    instantiate reports later with its own message."""
    try:
        return getattr(get_class(cfg.method._target_), "data_flow", None)
    except (ImportError, AttributeError, ValueError):
        return None


def validate_reward_modality(cfg: DictConfig) -> None:
    """A video reward on an image model (or an image reward on a video model), and monitor prompts of the other world
    (``monitor.prompts`` image prompts for a video model, or the reverse), are refused before anything loads.

    Raises:
        ValueError: naming the reward field, the model and the fix (``reward.per_frame`` wraps an image reward for
            videos).
    """
    model = target_modality((cfg.get("model") or {}).get("_target_"))
    if model is None:
        return
    monitor = cfg.get("monitor") or {}
    split = str(monitor.get("prompts", "heldout")) if monitor.get("every", 0) else None
    if split in ("train", "heldout") and model == "video":
        raise ValueError(f"monitor.prompts={split} are the image world's prompts but the model makes videos; pass "
                         "monitor.prompts=video_heldout (or a file of video prompts)")
    if split in ("video_train", "video_heldout") and model == "image":
        raise ValueError(f"monitor.prompts={split} are video prompts but the model makes images; pass "
                         "monitor.prompts=heldout")
    for field in ("reward", "eval_reward"):
        for name, node in (cfg.get(field) or {}).items():
            kind = target_modality((node or {}).get("_target_"))
            if kind is None or kind == model or kind == "any":  # "any": scores images and videos (brightness)
                continue
            if model == "image":
                raise ValueError(f"{field}=[...{name}...]: {name} scores videos (B, F, C, H, W) but model="
                                 f"{cfg.model._target_} makes images; pick an image reward (e.g. {field}=[geneval_shapes]"
                                 " or [clip_score]) or a video model (e.g. model=tiny_wan_t2v)")
            raise ValueError(f"{field}=[...{name}...]: {name} scores images (B, C, H, W) but model="
                             f"{cfg.model._target_} makes videos; wrap it per frame ({field}=[per_frame] "
                             f"{field}.per_frame.image_reward={name}) or pick a video reward (video_motion, "
                             "temporal_consistency)")


def validate_eval_config(cfg: DictConfig) -> None:
    """Checks the ``eval`` node (``diffalign-train``'s evaluation and ``diffalign-eval``): integer steps, seeds and
    sizes, a guidance scale >= 1, the bootstrap settings, the video format, a prompt file, and prompts every evaluation
    reward can score (a reward's ``check_prompts``).

    Raises:
        ValueError / FileNotFoundError: naming the field and the fix.
    """
    e, p = cfg.eval, "eval"
    boolean(e, "enabled", p)
    check_sampler_node(cfg, e.get("sampler"), "eval.sampler")
    if not e.seeds:
        raise ValueError("eval.seeds is empty; pass at least one seed, e.g. eval.seeds=[0,1]")
    int_list(e, "seeds", p, ge=0, min_length=1, unique=True)
    integer(e, "batch_size", p, ge=1)
    integer(e, "grid_images", p, ge=0)
    integer(e, "prompts_per_tag", p, ge=1, nullable=True, hint="null: every prompt")
    integer(e, "bootstrap_resamples", p, ge=1)
    number(e, "confidence", p, gt=0, lt=1, hint="e.g. 0.95")
    seed(e, "bootstrap_seed", p)
    choice(e, "video_format", p, VIDEO_FORMATS)
    boolean(e, "reuse_base", p)
    text(e, "prompts", p)
    rows = load_prompts(e.prompts, field="eval.prompts")
    for node in (cfg.get("eval_reward") or cfg.get("reward") or {}).values():  # the evaluation reward set
        check = target_attribute((node or {}).get("_target_"), "check_prompts")  # a reward that scores some prompts only
        if check is not None:
            check(rows, f"eval.prompts={e.prompts!r}")
