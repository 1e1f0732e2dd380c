"""LoRA files in and out: diffalign's own folders, diffusers-format files and kohya-format files (the key format
ComfyUI, AUTOMATIC1111/Forge, SD.Next and InvokeAI read), converted to and from the PEFT adapter of a policy's denoiser.

Every reader returns a `LoraWeights`: the adapter's tensors under PEFT's names relative to the denoiser
(``"<module>.lora_A.weight"`` of shape `(r, in)` — `(r, in, k, k)` for a convolution — and ``"<module>.lora_B.weight"``
of shape `(out, r)` / `(out, r, 1, 1)`), one rank r and one alpha α; the adapter adds ``(α / r) · B · A`` to each
module's weight. The formats (docs/guides/lora.md#file-formats):

- **diffusers** (what ``diffalign-train`` writes: ``pytorch_lora_weights.safetensors`` in ``checkpoint-<step>/`` and
  ``final/``): keys ``unet.<module>.lora.down.weight`` / ``.lora.up.weight`` (or PEFT's ``.lora_A`` / ``.lora_B``;
  ``transformer.`` for SD3 and Wan), the adapter config (r, α, targets) as ``lora_adapter_metadata``. Read with
  diffusers' own key conversion (`convert_unet_state_dict_to_peft`); without metadata α = r (diffusers' convention).
- **kohya** (one ``.safetensors`` file): ``lora_unet_<module with "." → "_">.lora_down.weight`` (= A),
  ``.lora_up.weight`` (= B) and ``.alpha`` (a scalar) per module; SD3 transformers use ``lora_transformer_`` (the
  OneTrainer naming ComfyUI reads for SD3). ``lora_unet_`` files (SD1.x/2.x, SDXL, also SDXL's ``input_blocks``
  naming) are read with diffusers' kohya converter (`StableDiffusionLoraLoaderMixin.lora_state_dict`, what
  ``load_lora_weights`` uses); diffusers 0.42 has no SD3 kohya reader, so ``lora_transformer_`` names are parsed here
  against the SD3 transformer's module names (`unflatten_module_name`). FLUX files use the original FLUX layer names
  (``lora_unet_double_blocks_<i>_img_attn_qkv``, ``lora_unet_single_blocks_<i>_linear1``, q/k/v fused), mapped both
  ways by `diffalign.models.flux` with the map of diffusers' FLUX kohya converter.

The family-specific parts are entries of `LAYOUTS` (one per model family: pipeline component, kohya prefix, the
``ss_base_model_version`` that A1111 shows, the diffusers pipeline whose ``save_lora_weights`` writes the diffusers
file). Only plain LoRA is read: LoCon/LoHa/LoKr/DoRA tensors and text-encoder LoRAs are refused with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import torch

from diffalign.runtime.files import readable_by_umask, save_safetensors

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
"""The file a diffalign (or diffusers) LoRA folder holds."""
KOHYA_DENOISER_PREFIXES = ("lora_unet_", "lora_transformer_")
KOHYA_TEXT_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_")
DIFFUSERS_TEXT_PREFIXES = ("text_encoder.", "text_encoder_2.", "text_encoder_3.")
UNSUPPORTED_KINDS = {r"\.dora_scale$": "DoRA", r"\.lora_magnitude_vector": "DoRA", r"\.lora_mid\.": "LoCon (Tucker)",
                     r"\.hada_": "LoHa", r"\.lokr_": "LoKr", r"\.diff(_b)?$": "full-weight difference",
                     r"\.lora_embedding_": "embedding"}
"""Tensor-name patterns of adapter kinds other than plain LoRA → their names (refused when read)."""


@dataclass(frozen=True)
class Layout:
    """How one model family's denoiser LoRA is named in each format (an entry of `LAYOUTS`).

    Attributes:
        name (`str`): ``"sd1"``, ``"sd2"``, ``"sdxl"`` or ``"sd3"``.
        component (`str`): the diffusers pipeline component of the denoiser (``"unet"``, ``"transformer"``), the key
            prefix of diffusers-format files.
        kohya_prefix (`str`): the key prefix of kohya-format files.
        base_model_version (`str`): kohya's ``ss_base_model_version`` metadata (A1111 lists a LoRA under it).
        pipeline (`str`): the diffusers pipeline class whose ``save_lora_weights`` / ``load_lora_weights`` handle the
            family's diffusers files.
        kohya_loader (`str` or `None`): the diffusers LoRA loader mixin that converts the family's kohya files (None:
            diffusers has none, the names are parsed here).
    """

    name: str
    component: str
    kohya_prefix: str
    base_model_version: str
    pipeline: str
    kohya_loader: str | None


LAYOUTS = {
    "sd1": Layout("sd1", "unet", "lora_unet_", "sd_v1", "StableDiffusionPipeline", "StableDiffusionLoraLoaderMixin"),
    "sd2": Layout("sd2", "unet", "lora_unet_", "sd_v2", "StableDiffusionPipeline", "StableDiffusionLoraLoaderMixin"),
    "sdxl": Layout("sdxl", "unet", "lora_unet_", "sdxl_base_v1-0", "StableDiffusionXLPipeline",
                   "StableDiffusionXLLoraLoaderMixin"),
    "sd3": Layout("sd3", "transformer", "lora_transformer_", "sd3", "StableDiffusion3Pipeline", None),
    "flux": Layout("flux", "transformer", "lora_unet_", "flux1", "FluxPipeline", "FluxLoraLoaderMixin"),
}
"""The model families with a kohya key map. SD1.x/2.x and SDXL share the UNet naming (kohya keys are the diffusers
module paths with "." → "_", which diffusers, ComfyUI and A1111 all read for both); SD3 uses ``lora_transformer_``;
FLUX uses the original (BFL) layer names, ``lora_unet_double_blocks_<i>_img_attn_qkv`` ... with q, k, v fused
(`diffalign.models.flux.flux_kohya_state_dict`), as kohya sd-scripts, ComfyUI and Forge do."""

CROSS_ATTENTION_FAMILIES = {768: "sd1", 1024: "sd2", 2048: "sdxl"}
"""UNet cross-attention width → family (SD1.x CLIP-L, SD2.x OpenCLIP-H, SDXL CLIP-L + bigG)."""


def layout_of_denoiser(denoiser) -> Layout | None:
    """The `Layout` of a diffusers denoiser module: an SDXL UNet (``addition_embed_type="text_time"``), an SD2 or SD1
    UNet (by ``cross_attention_dim``; a tiny one counts as SD1), an SD3 transformer; None for other families."""
    name = type(denoiser).__name__
    config = getattr(denoiser, "config", {})
    if name == "UNet2DConditionModel":
        if config.get("addition_embed_type") == "text_time":
            return LAYOUTS["sdxl"]
        return LAYOUTS["sd2"] if config.get("cross_attention_dim") == 1024 else LAYOUTS["sd1"]
    if name == "SD3Transformer2DModel":
        return LAYOUTS["sd3"]
    if name == "FluxTransformer2DModel":
        return LAYOUTS["flux"]
    return None


@dataclass
class LoraWeights:
    """A LoRA read from a file, as the PEFT adapter of a denoiser.

    Attributes:
        path (`Path`): the file read.
        source (`str`): ``"diffusers"`` (diffalign's and diffusers' files) or ``"kohya"``.
        component (`str`): ``"unet"`` or ``"transformer"``, the denoiser the file is for.
        state (`dict[str, torch.Tensor]`): ``"<module>.lora_A.weight"`` (r, in[, k, k]) and ``"<module>.lora_B.weight"``
            (out, r[, 1, 1]) tensors, as stored (dtype of the file).
        rank (`int`): r, the same for every module.
        alpha (`float`): α, the same for every module (scale α / r).
        target_modules (`list[str]`): the adapter's ``target_modules``: the file's config (diffalign/diffusers
            metadata) when it has one, else every adapted module's full path (what diffusers' loader does).
        layout (`Layout` or `None`): the model family when the file says or the names show it.
    """

    path: Path
    source: str
    component: str
    state: dict[str, torch.Tensor]
    rank: int
    alpha: float
    target_modules: list[str]
    layout: Layout | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        """The adapted modules' paths in the denoiser, sorted."""
        return sorted(k.removesuffix(".lora_A.weight") for k in self.state if k.endswith(".lora_A.weight"))

    @property
    def settings(self) -> dict:
        """The policy settings the file needs: ``{"lora_rank", "lora_alpha", "lora_target_modules"}``."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        return {"lora_rank": self.rank, "lora_alpha": alpha, "lora_target_modules": list(self.target_modules)}

    def describe(self) -> str:
        """One line for logs: file, format, modules, r and α."""
        return (f"{self.path} ({self.source} format, {len(self.modules)} {self.component} modules, r={self.rank}, "
                f"alpha={self.settings['lora_alpha']})")


# ---------------------------------------------------------------------------------------------------------- reading


def resolve_lora_file(path: str | os.PathLike, field_name: str = "path") -> Path:
    """The ``.safetensors`` file a LoRA path names: the file itself, or ``pytorch_lora_weights.safetensors`` in a
    folder (a ``checkpoint-<step>/`` or ``final/`` folder of a run, a diffusers LoRA folder).

    Raises:
        FileNotFoundError: naming `field_name` when the path does not exist or a folder holds no such file.
        ValueError: when the file is not ``.safetensors`` (pickled ``.bin`` / ``.pt`` files are not read).
    """
    p = Path(os.path.expanduser(str(path)))
    if p.is_dir():
        file = p / LORA_WEIGHT_NAME
        if not file.is_file():
            found = sorted(f.name for f in p.glob("*.safetensors"))
            hint = f" It holds {found}; pass one of them as a file." if found else ""
            raise FileNotFoundError(f"{field_name}={str(path)!r} is a folder without {LORA_WEIGHT_NAME}.{hint} Pass a "
                                    "checkpoint-<step>/ or final/ folder of a diffalign run, a diffusers LoRA folder, "
                                    "or a .safetensors LoRA file (diffusers or kohya format)")
        return file
    if not p.exists():
        raise FileNotFoundError(f"{field_name}={str(path)!r} does not exist; pass a LoRA folder or a .safetensors LoRA "
                                "file")
    if p.suffix != ".safetensors":
        raise ValueError(f"{field_name}={str(path)!r} is not a .safetensors file; diffalign reads LoRAs only from "
                         "safetensors (pickled .bin/.pt/.ckpt files can run code when loaded). Convert it, e.g. with "
                         "safetensors.torch.save_file(torch.load(f, weights_only=True), 'lora.safetensors')")
    return p


def _read_file(file: Path, field_name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safetensors.safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
            state = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (no __iter__)
    except (safetensors.SafetensorError, OSError) as err:
        raise ValueError(f"{field_name}: {file} cannot be read ({err}); the file is truncated or not a safetensors "
                         "file") from None
    if not state:
        raise ValueError(f"{field_name}: {file} holds no tensors")
    return state, metadata


def _refuse_other_kinds(keys, file: Path, field_name: str) -> None:
    for pattern, kind in UNSUPPORTED_KINDS.items():
        found = [k for k in keys if re.search(pattern, k)]
        if found:
            raise ValueError(f"{field_name}: {file} holds {kind} tensors (e.g. {found[0]!r}); diffalign reads plain "
                             "LoRA (lora_down/lora_up or lora_A/lora_B) only")


def read_lora(path: str | os.PathLike, *, field_name: str = "path", unet_config=None) -> LoraWeights:
    """Reads a LoRA folder or ``.safetensors`` file in diffusers or kohya format (see the module docstring).

    Args:
        path (`str` or `os.PathLike`): a folder holding ``pytorch_lora_weights.safetensors`` or a ``.safetensors`` file.
        field_name (`str`): the config field named in errors (e.g. ``"model.init_lora"``).
        unet_config (*optional*): the UNet's config, to map SDXL kohya files in ``input_blocks`` naming
            (`layers_per_block`); SDXL's (2) is assumed when not given.

    Returns:
        `LoraWeights`.

    Raises:
        FileNotFoundError: the path or the folder's file is missing.
        ValueError: one line naming `field_name`, the file, the tensor or metadata key, and the fix: not
            safetensors, unreadable, no LoRA tensors, text-encoder tensors, another adapter kind (DoRA, LoCon, LoHa,
            LoKr), a LoRA matrix that is not floating point, not 2-D / 4-D, of rank 0 or holding NaN / inf values, a
            kohya ``.alpha`` that is not one finite number > 0, down and up matrices of different ranks, ranks or
            alphas that differ between modules, metadata that is not JSON or has fields of the wrong type (an ``r``
            that is not an integer >= 1, a ``lora_alpha`` that is not a finite number > 0...), or kohya SD3 names
            diffalign cannot map. Checked before any model loads (`diffalign.lora.initial.adopt_init_lora`).
    """
    file = resolve_lora_file(path, field_name)
    state, metadata = _read_file(file, field_name)
    _refuse_other_kinds(state, file, field_name)
    _check_tensors(state, file, field_name)
    keys = list(state)
    if any(k.startswith(KOHYA_DENOISER_PREFIXES + KOHYA_TEXT_PREFIXES) for k in keys):
        weights = _read_kohya(file, state, metadata, field_name, unet_config)
    else:
        weights = _read_diffusers(file, state, metadata, field_name)
    weights.metadata = metadata
    return weights


MATRIX_SUFFIXES = (".lora_down.weight", ".lora_up.weight", ".lora_A.weight", ".lora_B.weight", ".lora.down.weight",
                   ".lora.up.weight")
"""The names of LoRA matrices in the formats read (kohya, PEFT, diffusers' old attention processors)."""
MATRIX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensors(state: dict[str, torch.Tensor], file: Path, field_name: str) -> None:
    """Every LoRA matrix (named by `MATRIX_SUFFIXES`) is floating point, 2-D (4-D for a convolution), of rank >= 1 and
    finite; every kohya ``.alpha`` is one finite number > 0. Names and shapes of other tensors are the format readers'
    business.

    Raises:
        ValueError: ``<field_name>: <file>: tensor '<name>' <reason>; <fix>``.
    """
    where = f"{field_name}: {file}: tensor"
    for key, value in state.items():
        if key.endswith(".alpha"):
            if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
                raise ValueError(f"{where} {key!r} is a {value.dtype} tensor of shape {tuple(value.shape)}; a kohya "
                                 "alpha is one real number (the LoRA's scale is alpha / rank). The file is damaged")
            alpha = float(value.reshape(()))
            if not math.isfinite(alpha) or alpha <= 0:
                raise ValueError(f"{where} {key!r} is alpha = {alpha:g}; a LoRA's alpha is a finite number > 0 (the "
                                 "scale is alpha / rank). The file is damaged")
            continue
        if not key.endswith(MATRIX_SUFFIXES):
            continue
        if value.dtype not in MATRIX_DTYPES:
            raise ValueError(f"{where} {key!r} has dtype {value.dtype}; LoRA matrices are float16, bfloat16 or "
                             "float32 (the file is damaged, or not a LoRA)")
        if value.ndim not in (2, 4):
            raise ValueError(f"{where} {key!r} has shape {tuple(value.shape)}; a LoRA matrix is 2-D (4-D for a "
                             "convolution). The file is damaged")
        if 0 in value.shape[:2]:
            raise ValueError(f"{where} {key!r} has shape {tuple(value.shape)}: rank 0; a LoRA's rank is >= 1. The "
                             "file holds no adapter")
        bad = int((~torch.isfinite(value)).sum())
        if bad:
            raise ValueError(f"{where} {key!r} holds {bad} non-finite values (NaN or inf) of {value.numel()}: it was "
                             "saved from a run that diverged; use an earlier checkpoint of it")


def _text_encoder_error(file: Path, field_name: str, count: int) -> ValueError:
    return ValueError(f"{field_name}: {file} holds {count} text-encoder LoRA tensors; diffalign trains a LoRA on the "
                      "denoiser only, so starting from this file would silently drop part of it. Use a LoRA trained "
                      "on the UNet/transformer alone (e.g. kohya's --network_train_unet_only), or remove the "
                      "lora_te*/text_encoder* tensors from the file if you accept the change")


def _uniform(values: dict[str, float], what: str, file: Path, field_name: str) -> float:
    distinct = sorted(set(values.values()))
    if len(distinct) > 1:
        example = {}
        for key, value in values.items():  # (a module of each of the first three values)
            if value in distinct[:3]:
                example.setdefault(value, key)
        raise ValueError(f"{field_name}: {file} has {len(distinct)} different LoRA {what}s ({example}); diffalign's "
                         f"policy adapter has one {what} for every module. Use a LoRA with a single {what}")
    return distinct[0]


def _ranks(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k.removesuffix(".lora_A.weight"): v.shape[0] for k, v in state.items() if k.endswith(".lora_A.weight")}


def _check_pairs(state: dict[str, torch.Tensor], file: Path, field_name: str) -> None:
    down = {k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")}
    up = {k.removesuffix(".lora_B.weight") for k in state if k.endswith(".lora_B.weight")}
    other = [k for k in state if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if other:
        raise ValueError(f"{field_name}: {file} holds tensors that are not LoRA matrices (e.g. {other[0]!r}); pass a "
                         "LoRA file")
    if down != up or not down:
        odd = sorted(down ^ up)[:2]
        raise ValueError(f"{field_name}: {file} holds no complete LoRA (modules without both matrices: {odd}); the "
                         "file is damaged or not a LoRA")
    for module in down:
        a, b = state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"]
        if b.shape[1] != a.shape[0] or a.ndim != b.ndim or (b.ndim == 4 and tuple(b.shape[2:]) != (1, 1)):
            raise ValueError(f"{field_name}: {file}: {module} has down {tuple(a.shape)} but up {tuple(b.shape)}; a "
                             "LoRA's up matrix is (out, rank) ((out, rank, 1, 1) for a convolution): the file is "
                             "damaged")


def _metadata_object(metadata: dict[str, str], key: str, file: Path, field_name: str) -> dict:
    """The JSON object stored under metadata `key`.

    Raises:
        ValueError: naming the file and the key, when it is not JSON or not an object.
    """
    try:
        value = json.loads(metadata[key])
    except ValueError as err:
        raise ValueError(f"{field_name}: {file}: metadata {key!r} is not JSON ({err}); the file's metadata is damaged "
                         "(re-export the LoRA, or drop the metadata: the tensors alone are read with alpha = rank)"
                         ) from None
    if not isinstance(value, dict):  # (a bad file: ValueError, as every other refusal of read_lora)
        kind = type(value).__name__
        raise ValueError(f"{field_name}: {file}: metadata {key!r} is a JSON {kind}, not an object; "  # noqa: TRY004
                         "the file's metadata is damaged (re-export the LoRA)")
    return value


def _check_config(config: dict, key: str, file: Path, field_name: str) -> dict:
    """`config`'s fields have the types PEFT's ``LoraConfig`` takes: ``r`` an integer >= 1, ``lora_alpha`` a finite
    number > 0, ``target_modules`` a list of strings or a string, ``rank_pattern`` / ``alpha_pattern`` objects.

    Raises:
        ValueError: ``<field_name>: <file>: metadata <key>: '<field>' is <value> (<type>); <what it must be>``.
    """
    def refuse(name: str, must: str) -> ValueError:
        value = config[name]
        return ValueError(f"{field_name}: {file}: metadata {key!r}: {name!r} is {repr(value)[:60]} "
                          f"({type(value).__name__}); it must be {must}. The file's metadata is damaged (re-export "
                          "the LoRA)")

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if "r" in config and not (isinstance(config["r"], int) and not isinstance(config["r"], bool) and config["r"] >= 1):
        raise refuse("r", "an integer >= 1")
    if "lora_alpha" in config and not (number(config["lora_alpha"]) and math.isfinite(config["lora_alpha"])
                                       and config["lora_alpha"] > 0):
        raise refuse("lora_alpha", "a finite number > 0")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise refuse("target_modules", "a list of module names or a regular expression")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise refuse(name, "an object")
    return config


def _config_from_metadata(metadata: dict[str, str], component: str, file: Path, field_name: str) -> dict | None:
    """The adapter config diffusers (≥ 0.35) and diffalign write as ``lora_adapter_metadata``
    (``{"<component>.r": ..., ...}``), or diffalign's kohya ``diffalign_lora_config``; None without one.

    Raises:
        ValueError: metadata that is not a JSON object, or fields of the wrong type (`_check_config`).
    """
    if "diffalign_lora_config" in metadata:
        key = "diffalign_lora_config"
        return _check_config(_metadata_object(metadata, key, file, field_name), key, file, field_name)
    if "lora_adapter_metadata" not in metadata:
        return None
    raw = _metadata_object(metadata, "lora_adapter_metadata", file, field_name)
    config = {k.split(".", 1)[1]: v for k, v in raw.items() if k.startswith(f"{component}.")}
    return _check_config(config, "lora_adapter_metadata", file, field_name) if config else None


def _read_diffusers(file: Path, state, metadata, field_name: str) -> LoraWeights:
    from diffusers.utils import convert_unet_state_dict_to_peft

    text = [k for k in state if k.startswith(DIFFUSERS_TEXT_PREFIXES)]
    if text:
        raise _text_encoder_error(file, field_name, len(text))
    components = sorted({k.split(".", 1)[0] for k in state})
    if len(components) != 1 or components[0] not in ("unet", "transformer"):
        raise ValueError(f"{field_name}: {file} is neither a kohya LoRA (lora_unet_*/lora_transformer_* keys) nor a "
                         f"diffusers one (unet.*/transformer.* keys); its keys start with {components[:4]}. Pass a "
                         "LoRA file")
    component = components[0]
    peft_state = convert_unet_state_dict_to_peft({k.split(".", 1)[1]: v for k, v in state.items()})
    _check_pairs(peft_state, file, field_name)
    rank = int(_uniform(_ranks(peft_state), "rank", file, field_name))
    config = _config_from_metadata(metadata, component, file, field_name)
    modules = sorted(k.removesuffix(".lora_A.weight") for k in peft_state if k.endswith(".lora_A.weight"))
    if config is not None:
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(f"{field_name}: {file} was saved with per-module ranks or alphas (rank_pattern/"
                             "alpha_pattern); diffalign's policy adapter has one rank and one alpha")
        if config.get("r", rank) != rank:
            raise ValueError(f"{field_name}: {file}'s metadata says r={config['r']} but its tensors have rank {rank}; "
                             "the file is inconsistent")
        alpha = float(config.get("lora_alpha", rank))
        targets = config.get("target_modules") or modules
        targets = sorted(targets) if isinstance(targets, list) else modules  # (a regex string: use the paths)
    else:
        alpha, targets = float(rank), modules  # diffusers' convention without metadata: alpha = r (scale 1)
    return LoraWeights(file, "diffusers", component, peft_state, rank, alpha, targets,
                       _layout_from_modules(component, peft_state))


def _layout_from_modules(component: str, state: dict[str, torch.Tensor]) -> Layout | None:
    """The family the module names and shapes show: SD3 for a transformer with diffusers' SD3 block names
    (``transformer_blocks.<i>.``; Wan's are ``blocks.<i>.``); a UNet by its cross-attention width (the input width of
    ``attn2.to_k`` / ``attn2.to_v``); None when unknown."""
    if component == "transformer":
        if any(k.startswith(("single_transformer_blocks.", "x_embedder.")) for k in state) or any(
                re.search(r"\.attn\.to_q\.lora_A\.weight$", k) and v.shape[-1] == 3072 for k, v in state.items()):
            return LAYOUTS["flux"]  # single-stream blocks, or FLUX.1's width 3072 (SD3.5-M: 1536, -L: 2432)
        return LAYOUTS["sd3"] if all(k.startswith(("transformer_blocks.", "context_embedder.", "pos_embed.",
                                                   "time_text_embed.", "norm_out.", "proj_out."))
                                     for k in state) else None
    for key, value in state.items():
        if re.search(r"\.attn2\.to_[kv]\.lora_A\.weight$", key):
            return LAYOUTS.get(CROSS_ATTENTION_FAMILIES.get(value.shape[1], ""))
    return None


def _read_kohya(file: Path, state, metadata, field_name: str, unet_config) -> LoraWeights:
    text = [k for k in state if k.startswith(KOHYA_TEXT_PREFIXES)]
    if text:
        raise _text_encoder_error(file, field_name, len(text))
    stray = [k for k in state if not k.startswith(KOHYA_DENOISER_PREFIXES)]
    prefixes = {p for p in KOHYA_DENOISER_PREFIXES if any(k.startswith(p) for k in state)}
    if stray or len(prefixes) != 1:
        example = stray[0] if stray else sorted(prefixes)
        raise ValueError(f"{field_name}: {file} mixes kohya keys with others ({example!r}); pass a single-model LoRA")
    for key in state:
        if not key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")):
            raise ValueError(f"{field_name}: {file}: {key!r} is not a kohya LoRA tensor (.lora_down.weight, "
                             ".lora_up.weight, .alpha)")
    names = sorted({k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in state})
    for name in names:
        if f"{name}.lora_down.weight" not in state or f"{name}.lora_up.weight" not in state:
            raise ValueError(f"{field_name}: {file}: {name} lacks lora_down or lora_up; the file is damaged")
    for name in names:
        down, up = state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"]
        if up.shape[1] != down.shape[0] or down.ndim != up.ndim:
            raise ValueError(f"{field_name}: {file}: {name} has lora_down {tuple(down.shape)} but lora_up "
                             f"{tuple(up.shape)}; a LoRA's up matrix is (out, rank): the file is damaged")
    from diffalign.models.flux import is_flux_kohya_name

    if any(is_flux_kohya_name(n) for n in names):
        return _read_kohya_flux(file, state, metadata, names, field_name)
    ranks = {n: state[f"{n}.lora_down.weight"].shape[0] for n in names}
    rank = int(_uniform(ranks, "rank", file, field_name))
    # kohya: a module without .alpha has alpha = its rank (scale 1)
    alphas = {n: float(state[f"{n}.alpha"].item()) if f"{n}.alpha" in state else float(ranks[n]) for n in names}
    alpha = _uniform(alphas, "alpha", file, field_name)
    (prefix,) = prefixes
    if prefix == "lora_unet_":
        component, paths = "unet", _unet_paths_with_diffusers(names, state, unet_config)
    else:
        component, paths = "transformer", {n: unflatten_module_name(n.removeprefix(prefix), sd3_vocabulary(),
                                                                    field_name=field_name) for n in names}
    peft_state = {}
    for name in names:
        peft_state[f"{paths[name]}.lora_A.weight"] = state[f"{name}.lora_down.weight"]
        peft_state[f"{paths[name]}.lora_B.weight"] = state[f"{name}.lora_up.weight"]
    modules = sorted(set(paths.values()))
    config = _config_from_metadata(metadata, component, file, field_name)
    targets = sorted(config["target_modules"]) if config and isinstance(config.get("target_modules"), list) \
        else modules
    layout = LAYOUTS.get(metadata.get("diffalign_family", "")) or _layout_from_modules(component, peft_state)
    return LoraWeights(file, "kohya", component, peft_state, rank, alpha, targets, layout)


def _read_kohya_flux(file: Path, state, metadata, names: list[str], field_name: str) -> LoraWeights:
    """A kohya FLUX file (``lora_unet_double_blocks_*`` ...): fused layers split into the diffusers modules as
    diffusers' converter splits them (`diffalign.models.flux.flux_modules_from_kohya`), α per module; zero padding
    blocks dropped."""
    from diffalign.models.flux import flux_modules_from_kohya

    modules = {}
    for name in names:
        if not name.startswith("lora_unet_"):
            raise ValueError(f"{field_name}: {file} mixes FLUX kohya names with {name!r}; pass a single-model LoRA")
        down, up = state[f"{name}.lora_down.weight"], state[f"{name}.lora_up.weight"]
        alpha = float(state[f"{name}.alpha"].item()) if f"{name}.alpha" in state else float(down.shape[0])
        try:
            modules.update(flux_modules_from_kohya(name, down, up, alpha))
        except ValueError as err:
            raise ValueError(f"{field_name}: {file}: {err}") from None
    peft_state = {}
    for module, (a, b, _) in modules.items():
        peft_state[f"{module}.lora_A.weight"], peft_state[f"{module}.lora_B.weight"] = a, b
    rank = int(_uniform({m: a.shape[0] for m, (a, _, _) in modules.items()}, "rank", file, field_name))
    alpha = _uniform({m: al for m, (_, _, al) in modules.items()}, "alpha", file, field_name)
    config = _config_from_metadata(metadata, "transformer", file, field_name)
    targets = sorted(config["target_modules"]) if config and isinstance(config.get("target_modules"), list) \
        else sorted(modules)
    return LoraWeights(file, "kohya", "transformer", peft_state, rank, alpha, targets, LAYOUTS["flux"])


def _unet_paths_with_diffusers(names: list[str], state, unet_config) -> dict[str, str]:
    """kohya ``lora_unet_*`` module name → the diffusers UNet module path, by diffusers' own kohya converter
    (`StableDiffusionLoraLoaderMixin.lora_state_dict`, which ``load_lora_weights`` runs; SDXL's ``input_blocks`` naming
    is mapped first with the UNet config, as ``StableDiffusionXLPipeline.load_lora_weights`` does)."""
    from types import SimpleNamespace

    from diffusers.loaders import StableDiffusionLoraLoaderMixin
    from diffusers.utils import convert_unet_state_dict_to_peft

    sgm = any(p in name for name in names for p in ("input_blocks", "middle_block", "output_blocks"))
    kwargs = {"unet_config": unet_config or SimpleNamespace(layers_per_block=2)} if sgm else {}
    paths = {}
    for name in names:  # one module at a time: the converter's output order does not have to follow the input's
        probe = {f"{name}.lora_down.weight": state[f"{name}.lora_down.weight"][:0],
                 f"{name}.lora_up.weight": state[f"{name}.lora_up.weight"][:, :0]}
        converted, _ = StableDiffusionLoraLoaderMixin.lora_state_dict(probe, **kwargs)
        peft = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
        (key,) = [k for k in peft if ".lora_A." in k]
        paths[name] = key.removesuffix(".lora_A.weight")
    return paths


_SD3_VOCABULARY: frozenset[str] | None = None


def module_vocabulary(model: torch.nn.Module) -> frozenset[str]:
    """Every dotted component of `model`'s module names that is not a number (e.g. ``transformer_blocks``, ``attn``,
    ``to_add_out``): the words kohya names are made of."""
    return frozenset(part for name, _ in model.named_modules() for part in name.split(".") if part and
                     not part.isdigit())


def sd3_vocabulary() -> frozenset[str]:
    """`module_vocabulary` of diffusers' `SD3Transformer2DModel` with every kind of block (dual attention, QK norm,
    the context-pre-only last block), built on the meta device (no memory, no weights)."""
    global _SD3_VOCABULARY
    if _SD3_VOCABULARY is None:
        from accelerate import init_empty_weights
        from diffusers import SD3Transformer2DModel

        with init_empty_weights(include_buffers=True):
            model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                          caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
                                          pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm")
        _SD3_VOCABULARY = module_vocabulary(model)
    return _SD3_VOCABULARY


def unflatten_module_name(flat: str, vocabulary: frozenset[str], *, field_name: str = "path") -> str:
    """A kohya module name without its prefix (``transformer_blocks_0_attn_to_add_out``) → the module path
    (``transformer_blocks.0.attn.to_add_out``): numbers are their own components, and at each position the longest
    run of ``_``-joined words that is in `vocabulary` is taken.

    Raises:
        ValueError: when a part of the name is no known module name (e.g. kohya sd-scripts' SD3 names
            ``joint_blocks_0_x_block_attn_qkv``, which name the fused qkv of the original MMDiT).
    """
    words, parts, i = flat.split("_"), [], 0
    while i < len(words):
        if words[i].isdigit():
            parts.append(words[i])
            i += 1
            continue
        for j in range(len(words), i, -1):
            candidate = "_".join(words[i:j])
            if candidate in vocabulary:
                parts.append(candidate)
                i = j
                break
        else:
            raise ValueError(f"{field_name}: the kohya module name {flat!r} does not name a module of diffusers' "
                             f"SD3 transformer (at {'_'.join(words[i:])!r}). diffalign reads SD3 LoRAs in diffusers "
                             "format (transformer.*) and in kohya format with diffusers module names "
                             "(lora_transformer_*, OneTrainer's and diffalign-export's); kohya sd-scripts' SD3 names "
                             "(lora_unet_joint_blocks_*, fused qkv) are not read — neither does diffusers 0.42")
    return ".".join(parts)


# ---------------------------------------------------------------------------------------------------------- writing


def kohya_state_dict(weights: LoraWeights, layout: Layout | None = None, dtype: torch.dtype | None = None
                     ) -> dict[str, torch.Tensor]:
    """The kohya-format tensors of `weights`: ``<prefix><module with "." → "_">.lora_down.weight`` (A),
    ``.lora_up.weight`` (B) and ``.alpha`` (float32 scalar α) per module, contiguous, in `dtype` (default: as read).

    Raises:
        ValueError: when the layout's component is not the file's.
    """
    layout = layout or weights.layout or (LAYOUTS["sd3"] if weights.component == "transformer" else LAYOUTS["sd1"])
    if layout.component != weights.component:
        raise ValueError(f"{weights.path} is a {weights.component} LoRA but the {layout.name} layout is for a "
                         f"{layout.component}")
    if layout.name == "flux":
        from diffalign.models.flux import flux_kohya_state_dict

        return flux_kohya_state_dict(weights.state, weights.rank, weights.alpha, dtype)
    out = {}
    for module in weights.modules:
        name = layout.kohya_prefix + module.replace(".", "_")
        for side, kohya in (("lora_A", "lora_down"), ("lora_B", "lora_up")):
            tensor = weights.state[f"{module}.{side}.weight"]
            out[f"{name}.{kohya}.weight"] = tensor.to(dtype or tensor.dtype).contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(weights.alpha), dtype=torch.float32)
    return out


def kohya_metadata(weights: LoraWeights, layout: Layout | None) -> dict[str, str]:
    """The safetensors metadata of a kohya export: kohya's ``ss_*`` keys (module, dim, alpha, base model version when
    the family is known) and ``diffalign_lora_config`` (r, α, targets) so that reading the file back restores the
    adapter config exactly."""
    metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(weights.rank),
                "ss_network_alpha": str(weights.settings["lora_alpha"]),
                "diffalign_lora_config": json.dumps({"r": weights.rank, "lora_alpha": weights.alpha,
                                                     "target_modules": list(weights.target_modules)})}
    if layout is not None:
        metadata["ss_base_model_version"] = layout.base_model_version
        metadata["diffalign_family"] = layout.name
    return metadata


def write_kohya(weights: LoraWeights, file: str | os.PathLike, *, layout: Layout | None = None,
                dtype: torch.dtype | None = None) -> Path:
    """Writes `weights` as one kohya-format ``.safetensors`` file (`kohya_state_dict`, `kohya_metadata`).

    Returns:
        `Path`: the file.
    """
    layout = layout or weights.layout
    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(kohya_state_dict(weights, layout, dtype), file, metadata=kohya_metadata(weights, layout))
    return file


def write_diffusers(weights: LoraWeights, directory: str | os.PathLike, *, layout: Layout | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Writes `weights` as a diffusers LoRA folder (``<directory>/pytorch_lora_weights.safetensors``) with the
    pipeline's own ``save_lora_weights`` (PEFT key names, the adapter config as metadata), which the family's
    ``load_lora_weights``, ``model.init_lora`` and ``reference.path`` read.

    Returns:
        `Path`: the file written.
    """
    import diffusers
    from peft import LoraConfig

    layout = layout or weights.layout or (LAYOUTS["sd3"] if weights.component == "transformer" else LAYOUTS["sd1"])
    pipeline = getattr(diffusers, layout.pipeline)
    config = LoraConfig(r=weights.rank, lora_alpha=weights.alpha, target_modules=list(weights.target_modules))
    tensors = {k: v.to(dtype or v.dtype).contiguous() for k, v in weights.state.items()}
    pipeline.save_lora_weights(save_directory=str(directory), safe_serialization=True,
                               **{f"{layout.component}_lora_layers": tensors,
                                  f"{layout.component}_lora_adapter_metadata": config.to_dict()})
    readable_by_umask(Path(directory) / LORA_WEIGHT_NAME)  # safetensors writes 0600
    return Path(directory) / LORA_WEIGHT_NAME


# ---------------------------------------------------------------------------------------------------------- policies


def policy_lora(policy) -> LoraWeights:
    """The policy's current adapter ``"default"`` as `LoraWeights` (float32 copies; source ``"policy"``).

    Raises:
        ValueError: for a policy without a LoRA adapter (``lora_rank=None``).
    """
    from peft import get_peft_model_state_dict

    denoiser = policy.denoiser
    if "default" not in getattr(denoiser, "peft_config", {}):
        raise ValueError("the policy has no LoRA adapter (model.lora_rank=null trains the whole denoiser)")
    config = denoiser.peft_config["default"]
    state = {k: v.detach().float().clone() for k, v in get_peft_model_state_dict(denoiser).items()}
    component = "unet" if getattr(policy, "unet", None) is denoiser else "transformer"
    targets = config.target_modules
    targets = sorted(targets) if not isinstance(targets, str) else sorted(
        k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight"))
    return LoraWeights(Path("<policy>"), "policy", component, state, int(config.r), float(config.lora_alpha), targets,
                       layout_of_denoiser(denoiser))


def load_into_policy(policy, weights: LoraWeights, *, field_name: str = "model.init_lora") -> None:
    """Copies `weights` into the policy's adapter ``"default"`` in place (parameters stay float32 and trainable).

    The policy's adapter must adapt exactly the file's modules with the file's rank and alpha (`adopt_settings`
    builds it so), so that the policy computes what the file's LoRA computes.

    Raises:
        ValueError: naming `field_name`: a policy without LoRA, a file for another denoiser (UNet vs transformer),
            modules the denoiser does not have (a LoRA for another model), modules, shapes, rank or alpha that differ
            from the adapter's.
    """
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    denoiser = policy.denoiser
    if "default" not in getattr(denoiser, "peft_config", {}):
        raise ValueError(f"{field_name} needs a LoRA policy, but model.lora_rank is null (the whole denoiser is "
                         "trained); leave model.lora_rank unset to take the file's rank")
    component = "unet" if getattr(policy, "unet", None) is denoiser else "transformer"
    if weights.component != component:
        raise ValueError(f"{field_name}: {weights.path} is a LoRA for a {weights.component} but this model's "
                         f"denoiser is a {component} ({type(denoiser).__name__}); use a LoRA trained on this model")
    config = denoiser.peft_config["default"]
    if int(config.r) != weights.rank or not math.isclose(float(config.lora_alpha), weights.alpha):
        raise ValueError(f"{field_name}: {weights.path} has r={weights.rank}, alpha={weights.settings['lora_alpha']} "
                         f"but the policy's adapter has r={config.r}, alpha={config.lora_alpha}; set model.lora_rank/"
                         "model.lora_alpha to the file's (or leave them unset: they are taken from the file)")
    expected = get_peft_model_state_dict(denoiser)
    present = {name for name, _ in denoiser.named_modules()}
    absent = [m for m in weights.modules if m not in present]
    if absent:
        raise ValueError(f"{field_name}: {weights.path}: module {absent[0]!r} (and {len(absent) - 1} more) is not in "
                         f"this model's {type(denoiser).__name__}: the LoRA is for another model; use a LoRA trained "
                         "on this model, or pass the LoRA's own model (model=...)")
    if set(expected) != set(weights.state):
        missing = sorted({k.rsplit(".", 2)[0] for k in set(expected) - set(weights.state)})
        extra = sorted({k.rsplit(".", 2)[0] for k in set(weights.state) - set(expected)})
        raise ValueError(f"{field_name}: {weights.path} adapts other modules than the policy's adapter (the adapter "
                         f"has {len(missing)} modules the file lacks, e.g. {missing[:2]}; the file has {len(extra)} "
                         f"the adapter lacks, e.g. {extra[:2]}); set model.lora_target_modules to the file's modules "
                         "(or leave it unset: they are taken from the file)")
    for key, value in weights.state.items():
        if value.shape != expected[key].shape:
            raise ValueError(f"{field_name}: {weights.path}: {key} has shape {tuple(value.shape)}, the policy's "
                             f"adapter {tuple(expected[key].shape)}; the LoRA is for another model size: use a LoRA "
                             "trained on this model, or pass the LoRA's own model (model=...)")
    result = set_peft_model_state_dict(denoiser, {k: v.float() for k, v in weights.state.items()})
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise ValueError(f"{field_name}: {weights.path}: tensors {unexpected[:2]} were not loaded")
