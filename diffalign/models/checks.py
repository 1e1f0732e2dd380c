"""The ``model`` node's checks, run before any model loads (`diffalign.config.validation`): every key is a setting the
model's builder takes, and the settings the shipped model configs use have the right type and range (LoRA rank and
alpha, dtype, frames, text length, the pretrained folder). A policy class may add its own checks as a classmethod
``check_config(cfg)``; it runs after these.
"""

from __future__ import annotations

import inspect

from omegaconf import OmegaConf

from diffalign.config.checks import (
    ConfigError,
    boolean,
    choice,
    integer,
    node_check,
    number,
    seed,
    target_attribute,
    text,
)

TORCH_DTYPE_NAMES = ("float32", "float16", "bfloat16")


def _builder_parameters(target: str) -> set[str] | None:
    """The keyword arguments the model's ``_target_`` accepts (a builder's own, plus its class's ``__init__``'s when it
    forwards ``**kwargs``); None when it cannot be imported or takes anything."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 - an unimportable target is reported by instantiate, with its own message
        return None
    params = inspect.signature(obj).parameters
    names = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        owner = obj.__self__ if inspect.ismethod(obj) and inspect.isclass(obj.__self__) else None
        if owner is None:
            return None
        init = inspect.signature(owner.__init__).parameters
        if any(p.kind == p.VAR_KEYWORD for p in init.values()):
            return None
        names |= {n for n, p in init.items() if n != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return names


@node_check("model")
def check_model_config(cfg) -> None:
    """Checks ``cfg.model`` (see the module docstring), then the policy class's own ``check_config`` if it has one.

    Raises:
        ConfigError: naming the field and the fix (``model.lora_rank=0``, an unknown key, ``torch_dtype=float64``, a
            local ``pretrained_model_name_or_path`` that is not a diffusers folder, ...).
    """
    m, p = cfg.get("model"), "model"
    if not m or "_target_" not in m:
        return
    accepted = _builder_parameters(m._target_)
    if accepted is not None:
        unknown = sorted(k for k in m if k not in ("_target_", "init_lora") and k not in accepted)  # (init_lora:
        # diffalign.lora.initial reads it and takes it out before the model is built)
        if unknown:
            raise ConfigError(f"model.{unknown[0]} is not a setting of model={m._target_}; it takes "
                              f"{sorted(accepted)}")
    integer(m, "lora_rank", p, ge=1, nullable=True, hint="null fine-tunes the whole denoiser instead of a LoRA")
    number(m, "lora_alpha", p, gt=0, nullable=True, hint="null: alpha = rank")
    if "lora_target_modules" in m:
        modules = m.lora_target_modules
        if (not (OmegaConf.is_list(modules) or isinstance(modules, (list, tuple))) or not len(modules)
                or not all(isinstance(x, str) and x for x in modules)):
            raise ConfigError(f"model.lora_target_modules must be a non-empty list of module names, e.g. "
                              f"[to_q,to_k,to_v,to_out.0], got {modules}")
    seed(m, "lora_seed", p)
    seed(m, "seed", p)
    choice(m, "torch_dtype", p, TORCH_DTYPE_NAMES)
    integer(m, "num_frames", p, ge=1)
    integer(m, "height", p, ge=8, nullable=True)
    integer(m, "width", p, ge=8, nullable=True)
    integer(m, "max_sequence_length", p, ge=1)
    integer(m, "sample_size_px", p, ge=16)
    number(m, "flow_shift", p, gt=0, nullable=True)
    boolean(m, "load_t5", p)
    boolean(m, "guidance_embeds", p)
    choice(m, "lora_experts", p, ("both", "high", "low"))
    number(m, "guidance_scale_2", p, ge=1, nullable=True, hint="Wan 2.2: the low-noise expert's CFG scale")
    number(m, "guidance", p, gt=0, nullable=True, hint="FLUX: the fixed embedded guidance, null: sampler.guidance_scale")
    boolean(m, "local_files_only", p, nullable=True)
    text(m, "revision", p, nullable=True)
    text(m, "variant", p, nullable=True)
    if OmegaConf.is_missing(m, "pretrained_model_name_or_path"):  # (`in` is False for a ``???`` value)
        raise ConfigError(f"model.pretrained_model_name_or_path is not set: model={m._target_} has no shipped weights; "
                          "pass model.pretrained_model_name_or_path=<a diffusers folder or hub id>")
    if "pretrained_model_name_or_path" in m:
        import os

        from diffalign.models.pipeline_policy import check_pipeline_folder

        text(m, "pretrained_model_name_or_path", p)
        path = str(m.pretrained_model_name_or_path)
        try:
            check_pipeline_folder(os.path.expanduser(path), path)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    check = target_attribute(m._target_, "check_config")
    if check is not None:
        check(cfg)
