"""Starting a training run from a saved LoRA: ``model.init_lora=<folder or .safetensors file>`` (docs/guides/lora.md).

The file (a diffalign ``checkpoint-<step>/`` or ``final/`` folder, a diffusers LoRA, or a kohya-format file; see
`diffalign.lora.io`) becomes the policy's adapter before the reference strategy is set up, so

- ``reference=frozen_base`` is the base model without any adapter (the init LoRA is part of the policy only);
- ``reference=checkpoint reference.path=<the same file>`` is the init LoRA itself: the policy starts equal to its
  reference (Diffusion-DPO loss ln 2, KL 0 at the first update);
- ``reference=ema`` and ``reference=pool`` start from the init LoRA (their θ_0 is the policy's initial adapter).

The adapter's rank, alpha and target modules are taken from the file (`adopt_init_lora`), replacing the model
config's; one set on the command line that differs from the file's is an error naming both. A resumed run
(``resume=latest`` with a checkpoint, or ``resume=<folder>``) loads its checkpoint's LoRA instead and ignores
``model.init_lora`` (it says so); its adapter settings come from the checkpoint.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from diffalign.lora.io import LORA_WEIGHT_NAME, LoraWeights, load_into_policy, read_lora

FIELD = "model.init_lora"
SETTINGS = ("lora_rank", "lora_alpha", "lora_target_modules")


def model_config(model_cfg: DictConfig) -> DictConfig:
    """The model config to instantiate: `model_cfg` without ``init_lora`` (which the policy constructors do not
    take; `build_policy` applies it)."""
    plain = OmegaConf.to_container(model_cfg, resolve=True)  # (interpolations resolved against the whole config)
    return OmegaConf.create({k: v for k, v in plain.items() if k != "init_lora"})


def resume_checkpoint(cfg: DictConfig) -> Path | None:
    """The checkpoint folder ``cfg.resume`` resumes from (``latest``: the newest in ``output_dir``, None when there is
    none), as `diffalign.train.common.Checkpoints.resume` picks it; None without ``resume``."""
    from diffalign.runtime.checkpoint import latest_checkpoint

    resume = cfg.get("resume")
    if resume is None:
        return None
    return latest_checkpoint(cfg.output_dir) if resume == "latest" else Path(resume)


def command_line_model_keys() -> set[str]:
    """The ``model.*`` fields set on the command line of the running Hydra app (``model.lora_rank=16`` →
    ``"lora_rank"``); empty outside one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return set()
    keys = (o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task)
    return {k.removeprefix("model.") for k in keys if k.startswith("model.")}


def _matches(module: str, target: str) -> bool:
    """PEFT's rule for a list of ``target_modules``: the module path equals the target or ends with ``.<target>``."""
    return module == target or module.endswith(f".{target}")


def _lora_settings_taken(cfg: DictConfig) -> tuple[str, ...]:
    """The LoRA settings the model's ``_target_`` takes (all of them when it takes ``**kwargs`` or cannot be
    inspected; a builder without ``lora_target_modules``, e.g. the tiny video models, keeps its own targets, which
    must then be the file's).

    Raises:
        ValueError: a model without ``lora_rank``.
    """
    from hydra.utils import get_method

    try:
        params = inspect.signature(get_method(cfg.model._target_)).parameters
    except Exception:  # noqa: BLE001 - an unimportable target is reported by instantiate, with its own message
        return SETTINGS
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return SETTINGS
    if "lora_rank" not in params:
        raise ValueError(f"{FIELD} needs a model with a LoRA adapter, but {cfg.model._target_} takes no lora_rank")
    return tuple(k for k in SETTINGS if k in params)


def check_lora_family(cfg: DictConfig, weights: LoraWeights, field: str = FIELD) -> None:
    """Refuses a LoRA for a UNet on a transformer model (or the reverse), seen from a local model folder's
    ``model_index.json``, before the model loads (a hub id is not looked up: peft names the mismatch at load).

    Raises:
        ValueError: naming `field`, the LoRA's denoiser, the model's and the fix.
    """
    path = cfg.model.get("pretrained_model_name_or_path")
    if not isinstance(path, str):
        return
    index = Path(os.path.expanduser(path)) / "model_index.json"
    if not index.is_file():
        return
    components = {k for k, v in json.loads(index.read_text()).items() if isinstance(v, list) and v[0] is not None}
    denoiser = next((c for c in ("unet", "transformer") if c in components), None)
    if denoiser is not None and denoiser != weights.component:
        raise ValueError(f"{field}: {weights.path} is a LoRA for a {weights.component}, but the model {path} has a "
                         f"{denoiser}; use a LoRA trained on this model (or model=... of the LoRA's family, e.g. "
                         f"model={'tiny_sd3' if weights.component == 'transformer' else 'tiny_sd'} in the tiny world)")


def meta_denoiser(cfg: DictConfig):
    """The denoiser of the local model folder ``cfg.model.pretrained_model_name_or_path`` built from its
    ``unet/`` or ``transformer/`` config on the meta device (its modules and shapes; no weights, no memory), or None
    when the model is not a local diffusers folder (a hub id, a randomly initialised tiny model) or its denoiser class
    is not diffusers'."""
    path = cfg.model.get("pretrained_model_name_or_path")
    if not isinstance(path, str):
        return None
    folder = Path(os.path.expanduser(path))
    if not (folder / "model_index.json").is_file():
        return None
    import diffusers
    from accelerate import init_empty_weights

    index = json.loads((folder / "model_index.json").read_text())
    for component in ("unet", "transformer"):
        entry = index.get(component)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers":
            cls = getattr(diffusers, str(entry[1]), None)
            if cls is None or not (folder / component / "config.json").is_file():
                return None
            with init_empty_weights(include_buffers=True):
                return cls.from_config(cls.load_config(folder / component))
    return None


def check_lora_fits(cfg: DictConfig, weights: LoraWeights, field: str = FIELD) -> None:
    """Refuses a LoRA whose modules the model's denoiser lacks, or whose matrices do not fit them (a LoRA of another
    model size: SD1.x's on SDXL, a LoRA of a wider tiny model), before the model loads: the denoiser is built on the
    meta device from the local model folder's config (`meta_denoiser`); a model that is not a local folder is not
    checked here (`diffalign.lora.io.load_into_policy` checks the shapes once it is loaded).

    Raises:
        ValueError: one line naming `field`, the file, the module or tensor, what the model has and the fix.
    """
    from torch import nn

    from diffalign.lora.io import layout_of_denoiser

    denoiser = meta_denoiser(cfg)
    if denoiser is None:
        return
    model = f"the model {cfg.model.pretrained_model_name_or_path}"
    theirs, ours = weights.layout, layout_of_denoiser(denoiser)
    family = (f" (the file's weights are {theirs.name}'s, the model is {ours.name})"
              if theirs is not None and ours is not None and theirs.name != ours.name else "")
    fix = ("use a LoRA trained on this model, or pass the LoRA's own model (model=... / "
           "model.pretrained_model_name_or_path=...)")
    modules = dict(denoiser.named_modules())
    for module in weights.modules:
        layer = modules.get(module)
        if layer is None:
            raise ValueError(f"{field}: {weights.path}: module {module!r} is not in {model}'s "
                             f"{type(denoiser).__name__}: the LoRA is for another model{family}; {fix}")
        down, up = weights.state[f"{module}.lora_A.weight"], weights.state[f"{module}.lora_B.weight"]
        if isinstance(layer, nn.Linear):
            fits, kind = down.ndim == 2 and down.shape[1] == layer.in_features and up.shape[0] == layer.out_features, \
                f"Linear({layer.in_features} → {layer.out_features})"
        elif isinstance(layer, nn.Conv2d):
            fits = (down.ndim == 4 and tuple(down.shape[1:]) == (layer.in_channels, *layer.kernel_size)
                    and up.shape[0] == layer.out_channels)
            kind = f"Conv2d({layer.in_channels} → {layer.out_channels}, kernel {tuple(layer.kernel_size)})"
        else:
            kind = type(layer).__name__  # (a bad file: ValueError, as every other refusal)
            raise ValueError(f"{field}: {weights.path}: module {module!r} of {model} is a {kind}, "  # noqa: TRY004
                             f"which a LoRA does not adapt (only Linear and Conv2d); the LoRA is for another model; "
                             f"{fix}")
        if not fits:
            raise ValueError(f"{field}: {weights.path}: tensors {module}.lora_A/B are {tuple(down.shape)} / "
                             f"{tuple(up.shape)} but {model}'s {module} is {kind}: the LoRA is for another model "
                             f"size{family}; {fix}")


def _same(key: str, current, wanted) -> bool:
    if key == "lora_target_modules":
        return current is not None and sorted(current) == sorted(wanted)
    if key == "lora_alpha" and current is not None:
        return float(current) == float(wanted)
    return current == wanted


def adopt_init_lora(cfg: DictConfig, explicit: Iterable[str] = ()) -> dict | None:
    """Reads ``model.init_lora`` (or, when the run resumes, its checkpoint's LoRA) and writes its rank, alpha and
    target modules into ``cfg.model``; call it before the model loads (the CLI does, with the command line's fields
    as `explicit`; `build_policy` again). Idempotent.

    Args:
        cfg (`DictConfig`): the training config (changed in place).
        explicit (`Iterable[str]`): ``model`` fields the user set explicitly (e.g. ``{"lora_rank"}``); a value that
            differs from the file's is an error. Other values (model and recipe defaults) give way to the file's.

    Returns:
        `dict` or `None`: the adopted ``{"lora_rank", "lora_alpha", "lora_target_modules"}``; None without
        ``model.init_lora``.

    Raises:
        FileNotFoundError: the file or folder does not exist.
        ValueError: naming ``model.init_lora`` and the fix: not a LoRA or a malformed one (`read_lora`: format,
            text-encoder or non-LoRA tensors, several ranks, dtypes, NaN / inf values, alphas, metadata), a LoRA for
            another denoiser than a local model folder's, or with modules it lacks or of another size
            (`check_lora_fits`), a model without LoRA settings, or an explicit setting that differs from the file's.
    """
    init = cfg.model.get("init_lora")
    if init is None:
        return None
    taken = _lora_settings_taken(cfg)
    explicit = set(explicit)
    ckpt = resume_checkpoint(cfg)
    source = f"the checkpoint {ckpt} (resume={cfg.resume})" if ckpt is not None else f"{FIELD}={init!r}"
    weights = read_lora(ckpt if ckpt is not None else init, field_name="resume" if ckpt is not None else FIELD)
    if ckpt is None:
        check_lora_family(cfg, weights)
        check_lora_fits(cfg, weights)
    settings = {k: v for k, v in weights.settings.items() if k in taken}
    for key in taken:
        current = cfg.model.get(key)
        if key in explicit and not _same(key, current, settings[key]):
            if key == "lora_target_modules" and current:
                uncovered = [m for m in weights.modules if not any(_matches(m, t) for t in current)]
                if not uncovered:  # explicit targets that cover the file's modules are kept (checked at load)
                    settings = {**settings, key: list(current)}
                    continue
                detail = f"which adapts modules these targets miss, e.g. {uncovered[:2]}"
            else:
                shown = settings[key] if key != "lora_target_modules" else f"{len(weights.modules)} modules"
                detail = f"which has {key.removeprefix('lora_')} {shown}"
            raise ValueError(f"model.{key}={current} (set on the command line) conflicts with {source}, {detail}; "
                             f"drop model.{key}=... (it is taken from the file) or pass a LoRA with that setting")
    with open_dict(cfg):
        for key in taken:
            cfg.model[key] = settings[key]
    return settings


def check_resume_lora(cfg: DictConfig) -> None:
    """Refuses a run that resumes (``resume=latest`` finding a checkpoint, or ``resume=<folder>``) from a checkpoint
    whose LoRA the configured model would not take: a LoRA for another denoiser (`check_lora_family`), with modules
    the model lacks or of another size (`check_lora_fits`), or of another rank, alpha or target modules than the
    config builds. That is a run resumed without the recipe or model overrides it was started with (``diffalign-train
    output_dir=runs/x resume=latest`` for a run started with ``recipe=tiny_dgpo``), which otherwise fails once the
    model has loaded, with "loaded state dict contains a parameter group that doesn't match". A run with
    ``model.init_lora`` adopts the checkpoint's settings instead (`adopt_init_lora`).

    Raises:
        ValueError: one line naming ``resume``, the checkpoint, the mismatch and the fix (the overrides the run was
            started with, kept in ``<output_dir>/.hydra/overrides.yaml``).
    """
    ckpt = resume_checkpoint(cfg)
    if ckpt is None or cfg.model.get("init_lora") is not None or not (Path(ckpt) / LORA_WEIGHT_NAME).is_file():
        return
    field = f"resume={cfg.resume}"
    fix = (f"resume with the overrides the run was started with (recipe=..., model=...: "
           f"{Path(str(cfg.output_dir)) / '.hydra' / 'overrides.yaml'})")
    weights = read_lora(ckpt, field_name="resume")
    try:
        check_lora_family(cfg, weights, field=field)
        check_lora_fits(cfg, weights, field=field)
    except ValueError as err:
        raise ValueError(f"{err}; to continue that run, {fix}") from None
    for key in _lora_settings_taken(cfg):
        current, saved = cfg.model.get(key), weights.settings.get(key)
        if key == "lora_target_modules":
            if current is None or isinstance(current, str):  # (the model's own targets, or a PEFT regex: peft checks)
                continue
            uncovered = [m for m in weights.modules if not any(_matches(m, t) for t in current)]
            if uncovered:
                raise ValueError(f"{field}: the checkpoint {ckpt} adapts modules model.lora_target_modules={list(current)} "
                                 f"misses, e.g. {uncovered[:2]}; {fix}")
        elif current is not None and saved is not None and not _same(key, current, saved):
            raise ValueError(f"{field}: the checkpoint {ckpt} was trained with {key}={saved}, the config builds "
                             f"model.{key}={current}; {fix}")


def _missing_targets(err: BaseException) -> set[str] | None:
    """The target modules of peft's "Target modules {...} not found in the base model" anywhere in `err`'s chain
    (Hydra wraps it in its "Error in call to target"), or None when it is another error."""
    import ast
    import re

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        found = re.search(r"Target modules (\{.*?\}) not found in the base model", str(err))
        if found:
            try:
                return set(ast.literal_eval(found.group(1)))
            except (ValueError, SyntaxError):
                return set()
        err = err.__cause__ or err.__context__
    return None


def build_policy(cfg: DictConfig, log: Callable[[str], None] = print):
    """The training loops' policy: ``cfg.model`` instantiated (without ``init_lora``), with ``model.init_lora``'s
    weights in its adapter unless the run resumes (then the checkpoint's LoRA is loaded later, by the loop, and this
    says so). Call before the reference strategy's ``setup``.

    Raises:
        FileNotFoundError, ValueError: see `adopt_init_lora` and `diffalign.lora.io.load_into_policy`; also a model
            (one without a local folder to check before it loads) that has none of the file's modules, named instead
            of peft's error inside Hydra's.
    """
    from hydra.utils import instantiate

    init = cfg.model.get("init_lora")
    if init is None:
        return instantiate(model_config(cfg.model))
    adopt_init_lora(cfg)
    try:
        policy = instantiate(model_config(cfg.model))
    except Exception as err:
        missing = _missing_targets(err)
        if missing is None:
            raise
        raise ValueError(f"{FIELD}: {init}: the model ({cfg.model.get('_target_')}) has none of the modules the "
                         f"LoRA adapts (e.g. {sorted(missing)[:2]}): the LoRA is for another model; use a LoRA trained "
                         "on this model, or pass the LoRA's own model (model=...)") from None
    ckpt = resume_checkpoint(cfg)
    if ckpt is not None:
        log(f"[diffalign] {FIELD}={init} is not loaded: the run resumes from {ckpt}, whose LoRA it continues")
        return policy
    weights = read_lora(init, field_name=FIELD, unet_config=getattr(policy.denoiser, "config", None))
    load_into_policy(policy, weights, field_name=FIELD)
    log(f"[diffalign] {FIELD}: the policy starts from {weights.describe()}")
    return policy
