"""Checks of a composed run config, done before any model is loaded (errors name the field and the fix)."""

from __future__ import annotations

from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from diffalign.methods import ONLINE_FLOWS, ONLINE_MEMBERS, check_method
from diffalign.samplers.configs import check_sampler
from diffalign.world.prompts import load_prompts

MIXED_PRECISION = ("no", "fp16", "bf16")


def _positive(cfg: DictConfig, key: str, value, strict: bool = True) -> None:
    if value is None or (value <= 0 if strict else value < 0):
        raise ValueError(f"{key} must be {'>' if strict else '>='} 0, got {value}")


def validate_train_config(cfg: DictConfig) -> None:
    """Raises ValueError / FileNotFoundError for a bad training config. Checks: method.beta > 0,
    num_inference_steps >= 1 (sampler and eval), trainer sizes and learning rate, mixed precision, at least one reward,
    the monitor, the data set's and the reference strategy's own checks (their ``check_config``: prompt and data files,
    a named reference checkpoint, ...; the data's only for methods that read it), reward modalities, the online
    settings with the method's own checks, the evaluation and the resume target."""
    method = cfg.get("method") or {}
    if "beta" in method:
        _positive(cfg, "method.beta", method.beta)
    for key in ("sampler", "eval"):
        node = cfg.get(key) or {}
        if "num_inference_steps" in node and (node.num_inference_steps is None or node.num_inference_steps < 1):
            raise ValueError(f"{key}.num_inference_steps must be >= 1, got {node.num_inference_steps}")
    t = cfg.trainer
    for k in ("max_steps", "batch_size", "gradient_accumulation_steps", "learning_rate"):
        _positive(cfg, f"trainer.{k}", t[k])
    if t.checkpointing_steps is not None and t.checkpointing_steps < 1:
        raise ValueError(f"trainer.checkpointing_steps must be >= 1 or null, got {t.checkpointing_steps}")
    if t.get("max_consecutive_nonfinite", 5) is None or t.get("max_consecutive_nonfinite", 5) < 1:
        raise ValueError(f"trainer.max_consecutive_nonfinite must be >= 1 (non-finite updates skipped in a row before "
                         f"the run stops with a checkpoint), got {t.max_consecutive_nonfinite}")
    if t.mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"trainer.mixed_precision must be one of {MIXED_PRECISION}, got {t.mixed_precision!r}")
    if not cfg.get("reward"):
        raise ValueError("no reward selected; pass e.g. reward=[geneval_shapes] (rewards score the evaluation)")
    monitor = cfg.get("monitor") or OmegaConf.create({})
    if monitor.get("every", 0) is None or monitor.get("every", 0) < 0:
        raise ValueError(f"monitor.every must be >= 0 (0 = off), got {monitor.get('every')}")
    if monitor.get("every", 0) > 0:
        eval_set = sorted(cfg.get("eval_reward") or cfg.reward)
        unknown = [n for n in (monitor.get("rewards") or []) if n not in eval_set]
        if unknown:
            raise ValueError(f"monitor.rewards: {unknown} not in the evaluation reward set {eval_set}; add them with "
                             "eval_reward=[...]")
        if monitor.get("diversity", True) and len(monitor.get("seeds") or []) < 2:
            raise ValueError(f"monitor.seeds={list(monitor.get('seeds') or [])}: diversity needs >= 2 seeds per prompt; "
                             "pass e.g. monitor.seeds=[0,1,2,3] or monitor.diversity=false")
        load_prompts(monitor.get("prompts", "heldout"), field="monitor.prompts")
    validate_reward_modality(cfg)
    if _method_flow(cfg) not in ONLINE_FLOWS:  # (online methods make their own samples; `data` is unused)
        check_component(cfg, "data")
    check_component(cfg, "reference")
    if "_target_" in method:
        validate_online_config(cfg)
    if cfg.eval.enabled:
        validate_eval_config(cfg)
    resume = cfg.get("resume")
    if resume not in (None, "latest") and not (Path(resume) / "trainer_state.json").is_file():
        raise FileNotFoundError(f"resume={resume!r} is not a checkpoint folder (no trainer_state.json); use "
                                "resume=latest or a path to a checkpoint-<step> folder")
    output_dir = Path(str(cfg.output_dir))
    if cfg.get("resume") is None and output_dir.is_dir() and any(output_dir.glob("checkpoint-*")):
        raise ValueError(f"output_dir={str(output_dir)!r} already holds checkpoints; pass resume=latest to continue "
                         "that run, or choose a new output_dir")


def check_component(cfg: DictConfig, group: str) -> None:
    """Runs the ``check_config(cfg)`` classmethod of what ``cfg.<group>._target_`` builds, when it has one: a
    component checks its own fields (e.g. a data set's files, `diffalign.reference.CheckpointReference`'s folder)."""
    check = target_attribute((cfg.get(group) or {}).get("_target_"), "check_config")
    if check is not None:
        check(cfg)


def target_modality(target: str | None) -> str | None:
    """``"image"`` / ``"video"``: the ``modality`` class attribute of what a config's ``_target_`` builds (a class, a
    classmethod such as ``StableDiffusionPolicy.from_pretrained``, or a builder function annotated with the class it
    returns); None when it does not say (e.g. a plugin without the attribute) or cannot be imported."""
    return target_attribute(target, "modality")


def target_attribute(target: str | None, name: str):
    """Class attribute `name` of what a config's ``_target_`` builds (see `target_modality`); None when unknown."""
    if not target:
        return None
    import inspect
    import typing

    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 - an unimportable target is reported by instantiate, with its own message
        return None
    owner = obj.__self__ if inspect.ismethod(obj) and inspect.isclass(obj.__self__) else obj
    if not inspect.isclass(owner):
        try:
            owner = typing.get_type_hints(obj).get("return")
        except Exception:  # noqa: BLE001 - unresolvable annotations: the target does not say
            return None
    return getattr(owner, name, None) if inspect.isclass(owner) else None


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
                                 " or [clip_score]) or a video model (e.g. model=tiny_t2v)")
            raise ValueError(f"{field}=[...{name}...]: {name} scores images (B, C, H, W) but model="
                             f"{cfg.model._target_} makes videos; wrap it per frame ({field}=[per_frame] "
                             f"{field}.per_frame.image_reward={name}) or pick a video reward (video_motion, "
                             "temporal_consistency)")


def validate_eval_config(cfg: DictConfig) -> None:
    """Checks the ``eval`` node: steps >= 1, a non-empty prompt file, at least one seed, batch size >= 1, bootstrap
    settings, video format, and prompts every evaluation reward can score (a reward's ``check_prompts``)."""
    e = cfg.eval
    if e.num_inference_steps is None or e.num_inference_steps < 1:
        raise ValueError(f"eval.num_inference_steps must be >= 1, got {e.num_inference_steps}")
    if not e.seeds:
        raise ValueError("eval.seeds is empty; pass at least one seed, e.g. eval.seeds=[0,1]")
    _positive(cfg, "eval.batch_size", e.batch_size)
    if e.get("bootstrap_resamples", 1) < 1:
        raise ValueError(f"eval.bootstrap_resamples must be >= 1, got {e.bootstrap_resamples}")
    if not 0 < e.get("confidence", 0.95) < 1:
        raise ValueError(f"eval.confidence must be in (0, 1), e.g. 0.95; got {e.confidence}")
    if e.get("video_format", "gif") not in ("gif", "mp4"):
        raise ValueError(f"eval.video_format must be gif or mp4, got {e.video_format!r}")
    rows = load_prompts(e.prompts, field="eval.prompts")
    for node in (cfg.get("eval_reward") or cfg.get("reward") or {}).values():  # the evaluation reward set
        check = target_attribute((node or {}).get("_target_"), "check_prompts")  # a reward that scores some prompts only
        if check is not None:
            check(rows, f"eval.prompts={e.prompts!r}")


def validate_online_config(cfg: DictConfig) -> None:
    """Checks of an online run's config that would otherwise fail after the models load: group size, the ``online``
    sizes and advantage options, the sampler option (`check_sampler`), the method's own checks (its ``check_config``:
    e.g. the sampler kind it needs) and the prompt file. Does nothing for offline methods."""
    flow = _method_flow(cfg)
    if flow not in ONLINE_FLOWS:
        return
    on = cfg.online
    if on.group_size < 2:
        raise ValueError(f"online.group_size={on.group_size}: group-relative advantages need at least 2 samples per "
                         "prompt; set online.group_size >= 2 (DGPO and Flow-GRPO use 16-24)")
    for key in ("num_epochs", "groups_per_epoch", "rollout_batch_size", "updates_per_epoch", "num_inner_epochs"):
        if on[key] < 1:
            raise ValueError(f"online.{key} must be >= 1, got {on[key]}")
    if on.advantage_std not in ("group", "global", "none"):
        raise ValueError(f"online.advantage_std must be 'group', 'global' or 'none', got {on.advantage_std!r}")
    if on.advantage_std_correction not in (0, 1):
        raise ValueError(f"online.advantage_std_correction must be 0 (population std: flow_grpo, DGPO) or 1 (sample "
                         f"std: DanceGRPO, ViPO), got {on.advantage_std_correction!r}")
    if not on.advantage_eps > 0:
        raise ValueError(f"online.advantage_eps must be > 0 (flow_grpo 1e-4, ViPO 1e-8), got {on.advantage_eps}")
    if on.get("split", "groups") not in ("groups", "members"):
        raise ValueError(f"online.split={on.split!r} must be 'groups' (whole groups per process) or 'members' (every "
                         "group spread over the processes)")
    best = on.get("best_of_n")
    if best is not None and (best < 2 or best % 2):
        raise ValueError(f"online.best_of_n={best} must be an even number >= 2 (n/2 best and n/2 worst per group), or "
                         "null")
    check_sampler(cfg)  # a sampler option of the model's family (diffalign.samplers.configs)
    method = get_class(cfg.method._target_)
    check_method(method, cfg.method._target_, ONLINE_FLOWS, ONLINE_MEMBERS, "online")
    method.check_config(cfg)  # the method's own checks (diffalign.methods)
    if on.prompts is None:
        raise ValueError("online.prompts is required by this recipe (it trains on your prompts, not the tiny world's); "
                         "pass online.prompts=<prompt file: .jsonl with GenEval metadata, .txt or .csv>")
    load_prompts(on.prompts, field="online.prompts")
