"""Run files with the mode the process's umask gives (``0o666 & ~umask``), not safetensors' 0600: every safetensors file
diffalign writes goes through `save_safetensors`, and a file another library writes with safetensors (diffusers'
``save_lora_weights``) is followed by `readable_by_umask`."""

from __future__ import annotations

import os

import torch


def readable_by_umask(path: str | os.PathLike) -> None:
    """Gives a written file the permissions the process's umask allows (``0o666 & ~umask``, e.g. 0644 under umask 022,
    0660 under a group's 007), the mode ``open(path, "w")`` would give it.

    safetensors (0.8) writes every file through a temporary file of mode 0600 and renames it, whatever the umask: a
    LoRA would be unreadable to another user (a ComfyUI server, a Docker mount), and a run's optimizer, RNG and
    reference states and prepared chunks unreadable to the group members who can read its LoRA and JSON files (they
    could evaluate a shared run but not resume it). `save_safetensors` calls this after every write; diffusers'
    ``save_lora_weights`` (which calls safetensors itself) is followed by it at its call sites."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, then `readable_by_umask`: every safetensors file
    diffalign writes (checkpoints' states, prepared data chunks, DDSPO shards, exported LoRAs) gets the mode of the
    run's other files. The one place diffalign calls ``save_file`` (tests/test_code_shape.py checks it)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    readable_by_umask(path)
