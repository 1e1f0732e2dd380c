"""``diffalign-export``: converts a run's LoRA (or any LoRA diffalign reads) to the kohya key format that ComfyUI,
AUTOMATIC1111/Forge, SD.Next and InvokeAI load, or to a diffusers LoRA folder (docs/guides/lora.md).

    diffalign-export runs/my-run/final my-run.safetensors                  # kohya format (default)
    diffalign-export runs/my-run/checkpoint-200 my-run-200.safetensors --dtype float16
    diffalign-export civitai-lora.safetensors runs/imported --format diffusers   # kohya -> a diffusers folder

The source is a ``checkpoint-<step>/`` or ``final/`` folder, a run folder (its ``final/``), a diffusers LoRA folder or
file, or a kohya file. Kohya export covers SD1.x/2.x and SDXL UNets (``lora_unet_*``), SD3 transformers
(``lora_transformer_*``) and FLUX.1 transformers (``lora_unet_double_blocks_*`` / ``lora_unet_single_blocks_*``, the
original FLUX layer names with q, k, v fused, which ComfyUI and Forge read); other families (video models) export to
diffusers format only.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from diffalign.lora.io import (
    CROSS_ATTENTION_FAMILIES,
    LAYOUTS,
    LORA_WEIGHT_NAME,
    LoraWeights,
    read_lora,
    write_diffusers,
    write_kohya,
)
from diffalign.runtime.console import quiet_on_broken_pipe
from diffalign.runtime.storage import DiskFullError, atomic_file, write_folder

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
VIDEO_MODULE_HINTS = ("temp_attentions", "transformer_in", "temporal")


def _source(path: str) -> Path:
    """A run folder (no LoRA file of its own, a ``final/`` inside) stands for its ``final/``."""
    p = Path(path)
    if p.is_dir() and not (p / LORA_WEIGHT_NAME).is_file() and (p / "final" / LORA_WEIGHT_NAME).is_file():
        return p / "final"
    return p


CROSS_ATTENTION_WIDTHS = {family: width for width, family in CROSS_ATTENTION_FAMILIES.items()}
"""UNet family → its cross-attention width (the input width of every ``attn2.to_k`` / ``attn2.to_v``)."""


def check_family(weights: LoraWeights, family: str) -> None:
    """`family` (``--family``) against the weights: its denoiser (UNet or transformer) and, for a UNet family, the
    input width of the file's cross-attention keys and values (SD1.x 768, SD2.x 1024, SDXL 2048), which tells the
    families apart; an SD3 LoRA must adapt SD3's blocks (`lora_io.LAYOUTS`).

    Raises:
        ValueError: naming the flag, the file, the tensor that shows the family and the fix.
    """
    layout = LAYOUTS[family]
    if layout.component != weights.component:
        raise ValueError(f"--family {family} is a {layout.component} family but {weights.path} is a "
                         f"{weights.component} LoRA")
    if layout.component == "transformer":
        if weights.layout is None or weights.layout.name != family:
            raise ValueError(f"--family {family}: {weights.path} does not adapt SD3's transformer blocks (its "
                             f"modules are e.g. {weights.modules[:2]}); use --format diffusers")
        return
    width = CROSS_ATTENTION_WIDTHS[family]
    for key, value in sorted(weights.state.items()):
        if re.search(r"\.attn2\.to_[kv]\.lora_A\.weight$", key) and value.shape[1] != width:
            shown = CROSS_ATTENTION_FAMILIES.get(value.shape[1])
            raise ValueError(f"--family {family}: {weights.path} is not an {family} LoRA: its tensor {key} takes "
                             f"{value.shape[1]} inputs, {family}'s cross-attention width is {width}"
                             f"{f' ({shown} has {value.shape[1]})' if shown else ''}; pass "
                             f"{f'--family {shown}' if shown else 'the family it was trained on'} or --family auto")


def _layout(weights: LoraWeights, family: str):
    """The key map to write with: `family` when given (checked against the file, `check_family`), else what the
    file shows."""
    if family != "auto":
        check_family(weights, family)
        return LAYOUTS[family]
    if weights.layout is not None:
        return weights.layout
    if weights.component == "transformer" or any(h in m for m in weights.modules for h in VIDEO_MODULE_HINTS):
        raise ValueError(f"{weights.path} is not an SD1.x/2.x, SDXL, SD3 or FLUX LoRA (its modules are e.g. "
                         f"{weights.modules[:2]}); kohya export covers those families only: use --format diffusers")
    return None  # a UNet of unknown size (e.g. the tiny world's): SD keys, no ss_base_model_version


def export(source: str, destination: str, *, fmt: str = "kohya", dtype: str = "float32", family: str = "auto",
           overwrite: bool = False) -> Path:
    """Converts the LoRA at `source` and writes it to `destination` (see the module docstring).

    Returns:
        `Path`: the file written.

    Raises:
        FileNotFoundError, ValueError: an unreadable or malformed source (`diffalign.lora.io.read_lora`), a
            destination that exists (without `overwrite`), has the wrong form (a folder for a file, a file for a
            folder) or cannot be written (`check_writable`), a `family` the weights contradict (`check_family`), or a
            family kohya export does not cover.
        DiskFullError: the disk filled up (written through a temporary file: no partial LoRA is left).
    """
    if fmt not in ("kohya", "diffusers"):
        raise ValueError(f"--format must be kohya or diffusers, got {fmt!r}")
    weights = read_lora(_source(source), field_name="source")
    out = Path(destination)
    if fmt == "kohya":
        if out.suffix != ".safetensors":
            raise ValueError(f"the kohya destination {destination!r} must be a .safetensors file name")
        if out.is_dir():
            raise ValueError(f"the kohya destination {destination!r} is a folder; pass a file name, e.g. "
                             f"{str(out / 'lora.safetensors')!r}")
        if out.exists() and not overwrite:
            raise ValueError(f"{destination!r} exists; pass --overwrite to replace it")
        layout = _layout(weights, family)
        check_writable(out.parent, destination)
        # (through a temporary file: a full disk leaves no truncated .safetensors; DiskFullError names the folder)
        return atomic_file(out, lambda tmp: write_kohya(weights, tmp, layout=layout, dtype=DTYPES[dtype]),
                           what=f"the exported LoRA {out.name}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"the diffusers destination {destination!r} is a file; pass a folder (it gets "
                         f"{LORA_WEIGHT_NAME})")
    if (out / LORA_WEIGHT_NAME).exists() and not overwrite:
        raise ValueError(f"{destination!r} already holds {LORA_WEIGHT_NAME}; pass --overwrite to replace it")
    if out.suffix == ".safetensors":
        raise ValueError(f"the diffusers destination {destination!r} is a folder (it gets {LORA_WEIGHT_NAME}); drop "
                         "the .safetensors suffix")
    if family != "auto":
        check_family(weights, family)
    layout = LAYOUTS[family] if family != "auto" else weights.layout
    check_writable(out, destination)
    write_folder(out, lambda tmp: write_diffusers(weights, tmp, layout=layout, dtype=DTYPES[dtype]),
                 what=f"the exported LoRA {out.name}/{LORA_WEIGHT_NAME}")
    return out / LORA_WEIGHT_NAME


def check_writable(folder: Path, destination: str) -> None:
    """`folder` (made if missing) can hold a new file: a temporary file is created in its nearest existing folder and
    removed again (which catches read-only mounts, where `os.access` says yes to root).

    Raises:
        ValueError: naming the destination, the folder and the reason.
    """
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"cannot write {destination!r}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".diffalign-write-test-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise ValueError(f"cannot write {destination!r}: {probe} is not writable ({err.strerror}); pass a destination "
                         "in a folder you can write") from None


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> None:
    """``diffalign-export SOURCE DESTINATION [--format kohya|diffusers] [--dtype ...] [--family ...]``."""
    parser = argparse.ArgumentParser(prog="diffalign-export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a checkpoint-<step>/ or final/ folder, a run folder, or a LoRA file")
    parser.add_argument("destination", help="kohya: a .safetensors file; diffusers: a folder")
    parser.add_argument("--format", dest="fmt", choices=("kohya", "diffusers"), default="kohya")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the LoRA matrices (alpha stays float32); float16 halves the file")
    parser.add_argument("--family", choices=("auto", *LAYOUTS), default="auto",
                        help="model family for the key map and ss_base_model_version (auto: from the file)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    args = parser.parse_args(argv)
    try:
        written = export(args.source, args.destination, fmt=args.fmt, dtype=args.dtype, family=args.family,
                         overwrite=args.overwrite)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"diffalign-export: error: {err}")
    except DiskFullError as err:
        err.hint = "run the same command again"
        sys.exit(f"diffalign-export: error: {err}")
    except OSError as err:  # (the checks above make this rare: a disk that fills up, a folder removed meanwhile)
        sys.exit(f"diffalign-export: error: cannot write {args.destination!r}: {err.strerror or err}: "
                 f"{err.filename or args.destination}")
    weights = read_lora(written, field_name="destination")
    print(f"[diffalign] wrote {weights.describe()}")
    if args.fmt == "kohya":
        print("[diffalign] ComfyUI: copy it to models/loras/ (LoraLoaderModelOnly); A1111/Forge: models/Lora/; "
              "diffusers: pipe.load_lora_weights(path) (SD1.x/2.x/SDXL/FLUX); diffalign: model.init_lora=<path>")
