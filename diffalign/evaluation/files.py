"""An evaluation's files and its resume: the checkpoints it names, ``samples.jsonl`` and ``eval_state.json`` (which
(variant, prompt) samples are finished and from which weights), the saved images and videos, and the reuse of the base
model's samples from an identical earlier evaluation beside it.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

from diffalign.evaluation.generation import EvalConfig, image_seed
from diffalign.runtime.media import save_png, save_video
from diffalign.runtime.storage import atomic_file, write_text

LORA_FILE = "pytorch_lora_weights.safetensors"


def check_checkpoint_exists(field: str, spec: str) -> None:
    """Refuses a checkpoint path that does not exist, in one line naming the field (``checkpoint`` or ``checkpoints``)
    and the fix, before any model loads; where the path's parent folder exists, the line lists the LoRA folders in it
    (a typo such as ``runs/x/finall``).

    Args:
        field (`str`): the config field the path came from, as the user typed it.
        spec (`str`): the path.

    Raises:
        FileNotFoundError: `spec` does not exist.
    """
    path = Path(spec)
    if path.exists():
        return
    parent = path.parent
    beside = [p.name for p in parent.iterdir() if (p / LORA_FILE).is_file()] if parent.is_dir() else []
    beside.sort(key=lambda name: (re.sub(r"\d+", "", name), int(re.sub(r"\D", "", name) or 0), name))
    where = f" ({str(parent)!r} holds {', '.join(beside)})" if beside else ""
    listed = field == "checkpoints"
    named = f"{field}: {spec!r}" if listed else f"{field}={spec!r}"
    example = "checkpoints=[base,runs/my-run/final]" if listed else "checkpoint=runs/my-run/final"
    raise FileNotFoundError(f"{named} does not exist{where}; pass the checkpoint-<step>/ or final/ folder of a "
                            f"diffalign-train run, e.g. {example}")


def resolve_checkpoints(specs: list[str]) -> dict[str, bool | Path]:
    """Variants for `evaluate_policy` from a checkpoint list such as ``[base, runs/x/final, runs/x]``.

    ``base`` is the adapter-disabled model (``True``); a folder holding ``pytorch_lora_weights.safetensors`` is one
    checkpoint, labelled ``<parent>/<folder>`` (``x/final``); a run folder holding ``checkpoint-<step>/`` folders
    expands to them in step order (its ``final/`` equals the last checkpoint and is not added).

    Raises:
        ValueError: for an empty list or a checkpoint listed twice (two equal labels).
        FileNotFoundError: for an entry that does not exist (`check_checkpoint_exists`) or is neither ``base``, a
            LoRA folder nor a run folder.
    """
    if not specs:
        raise ValueError("checkpoints is empty; pass e.g. checkpoints=[base,runs/my-run/final]")
    variants: dict[str, bool | Path] = {}

    def add(label: str, value: bool | Path) -> None:
        if label in variants:
            raise ValueError(f"checkpoint {label!r} is listed twice in checkpoints={list(specs)}; list it once")
        variants[label] = value

    for spec in specs:
        spec = str(spec)
        if spec == "base":
            add("base", True)
            continue
        check_checkpoint_exists("checkpoints", spec)
        path = Path(spec)
        if (path / LORA_FILE).is_file():
            add(f"{path.resolve().parent.name}/{path.name}", path)
            continue
        steps = sorted((int(m.group(1)), p) for p in path.glob("checkpoint-*")
                       if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and (p / LORA_FILE).is_file())
        if not steps:
            raise FileNotFoundError(f"checkpoints: {spec!r} is neither 'base', a folder holding {LORA_FILE} (a "
                                    "checkpoint-<step>/ or final/ folder) nor a run folder holding checkpoint-<step>/ "
                                    "folders")
        for _, p in steps:
            add(f"{path.resolve().name}/{p.name}", p)
    return variants


def checkpoint_step(label: str) -> int | None:
    """The training step of a ``.../checkpoint-<step>`` label, else None."""
    m = re.search(r"checkpoint-(\d+)$", label)
    return int(m.group(1)) if m else None


def label_slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)


def variant_fingerprint(policy, spec: bool | str | Path) -> str:
    """What a variant samples from: the adapter-disabled base, the hash of the policy's trainable parameters
    (the policy as it is), or the hash of a LoRA file. A re-run reuses a variant's samples only for an equal one."""
    digest = hashlib.sha256()
    if spec is True:
        return f"adapter-disabled:{base_weights_hash(policy)}"
    if spec is False:
        for p in policy.trainable_parameters():
            digest.update(p.detach().float().cpu().clone().numpy().tobytes())  # (a copy: see below)
        return f"policy:{digest.hexdigest()[:16]}"
    digest.update((Path(spec) / LORA_FILE).read_bytes())
    return f"lora:{digest.hexdigest()[:16]}"


def base_weights_hash(policy) -> str:
    """A 16-hex-digit SHA-256 of the policy's frozen weights (every parameter and buffer of its modules except LoRA
    adapters and trainable parameters): what the adapter-disabled base samples from. Cached on the policy per
    (name, shape, dtype, data pointer, version) signature, so it is computed once per run."""
    trainable = {id(p) for p in policy.trainable_parameters()}
    tensors = [(name, t) for name, t in sorted(policy.state_dict(keep_vars=True).items())
               if id(t) not in trainable and ".lora_" not in name]
    signature = tuple((name, tuple(t.shape), str(t.dtype), t.data_ptr(), t._version) for name, t in tensors)
    cached = policy.__dict__.get("_base_weights_hash")
    if cached is not None and cached[0] == signature:
        return cached[1]
    digest = hashlib.sha256()
    for name, t in sorted((n.replace(".base_layer.", "."), t) for n, t in tensors):  # a LoRA-wrapped layer's
        digest.update(name.encode())                                                # weight is ...base_layer.weight
        # (from a copy: .numpy() of a weight's own storage marks it not resizable, and FSDP's summon_full_params
        # can then not free its gathered weights: "Trying to resize storage that is not resizable")
        digest.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).clone().numpy().tobytes())
    policy.__dict__["_base_weights_hash"] = (signature, digest.hexdigest()[:16])
    return digest.hexdigest()[:16]


def base_reuse_key(model_cfg, reward_cfg) -> dict:
    """The settings besides the weights that decide the base model's samples and scores: the model config without
    its LoRA fields (``num_frames``, ``max_sequence_length``, dtype, ...) and the reward configs (e.g. a verifier's
    ``score=binary``). Plain JSON-able dicts from OmegaConf nodes or dicts."""
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})

    model = {k: v for k, v in plain(model_cfg).items() if not k.startswith("lora_") and k != "init_lora"}
    return json.loads(json.dumps({"model": model, "rewards": plain(reward_cfg)}, sort_keys=True, default=str))


def find_reusable_base(out_dir: Path, key: dict, fingerprint: str, num_rows: int, seeds: list[int],
                       max_candidates: int = 64, *, base_key: dict | None = None) -> tuple[Path, list[dict]] | None:
    """An earlier, finished evaluation of the same base model beside `out_dir`, and its samples of that base.

    Looks at ``<root>/*/eval_state.json`` and ``<root>/*/eval/eval_state.json``, where ``<root>`` is the folder that
    holds the run folder (``runs/`` for ``runs/train-<time>/eval`` and for ``runs/eval-<time>``), newest first, at
    most `max_candidates`. A candidate qualifies when its resume key equals `key` apart from ``context`` (same
    prompts, seeds, sampler, rewards, video format), its `base_key` equals `base_key` (model and reward settings,
    `base_reuse_key`), one of its variants has `fingerprint` (the same frozen base weights, `base_weights_hash`), and
    that variant has every (prompt, seed) sample with its image file.

    Returns:
        ``(folder, samples)`` of the first qualifying evaluation, or None.
    """
    out_dir = Path(out_dir).resolve()
    root = out_dir.parent.parent if out_dir.name == "eval" else out_dir.parent
    found = [p for pattern in ("*/eval_state.json", "*/eval/eval_state.json") for p in root.glob(pattern)]
    found = sorted((p for p in found if p.parent.resolve() != out_dir), key=lambda p: p.stat().st_mtime,
                   reverse=True)[:max_candidates]
    wanted = {k: v for k, v in key.items() if k != "context"}
    for state_path in found:
        try:
            state = json.loads(state_path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if {k: v for k, v in state.get("key", {}).items() if k != "context"} != wanted:
            continue
        if base_key is None or state.get("base_key") != base_key:
            continue
        labels = [label for label, fp in state.get("fingerprints", {}).items() if fp == fingerprint]
        if not labels:
            continue
        folder = state_path.parent
        rows = [s for s in read_samples(folder / "samples.jsonl") if s.get("variant") == labels[0]]
        have = {(s["prompt_index"], s["seed"]) for s in rows}
        if have != {(p, s) for p in range(num_rows) for s in seeds}:
            continue
        if all((folder / s["image"]).is_file() and ("video" not in s or (folder / s["video"]).is_file())
               for s in rows):
            return folder, rows
    return None


def adopt_base(source: Path, rows: list[dict], out_dir: Path, label: str, slug: str) -> list[dict]:
    """Copies the reused base samples' files into `out_dir` under this evaluation's variant `label`."""
    import shutil

    adopted = []
    for row in rows:
        row = dict(row, variant=label)
        for field_name in ("image", "video"):
            if field_name in row:
                name = Path(row[field_name]).name
                target = f"images/{slug}/{name}"
                atomic_file(out_dir / target, lambda tmp, src=source / row[field_name]: shutil.copyfile(src, tmp),
                            what=str(out_dir / target))
                row[field_name] = target
        adopted.append(row)
    return adopted


def read_samples(path: Path) -> list[dict]:
    """Rows of a samples.jsonl; a last line cut short by an interruption is dropped."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def write_samples(path: Path, samples: list[dict]) -> None:
    """Writes ``samples.jsonl`` whole, through a temporary file and a rename (`DiskFullError` on a full disk)."""
    write_text(path, "".join(json.dumps(s) + "\n" for s in samples), what=str(path))


def earlier_state(out_dir: Path, key: dict, resume: bool, log) -> tuple[dict, list[dict]]:
    """The state and finished samples of an earlier evaluation in `out_dir` made with the same `key` (when
    `resume`), else a fresh state and no samples (saying so when the settings differ)."""
    state_path = out_dir / "eval_state.json"
    state = json.loads(state_path.read_text()) if resume and state_path.is_file() else None
    if state is not None and state.get("key") != key:
        log(f"eval: the settings differ from the earlier evaluation in {out_dir}; starting over")
        state = None
    if state is None:
        return {"key": key, "fingerprints": {}}, []
    return state, read_samples(out_dir / "samples.jsonl")


def save_sample(images: torch.Tensor, scored: dict, i: int, label: str, slug: str, rows: list[dict], p: int, s: int,
                 cfg: EvalConfig, out_dir: Path) -> dict:
    """Saves image (or video) `i` of a batch, prompt `p` with seed `s`, under ``images/<slug>/``; returns its
    ``samples.jsonl`` record with every reward's score and correctness."""
    stem = f"images/{slug}/p{p:05d}_s{s}"
    record = {"variant": label, "prompt": rows[p]["prompt"], "seed": s, "image_seed": image_seed(s, p),
              "prompt_index": p, "tag": rows[p].get("tag"), "image": f"{stem}.png"}
    if images.ndim == 5:  # a video (F, C, H, W): the file, and its first frame for the grids
        record["video"] = str(save_video(images[i], out_dir / f"{stem}.{cfg.video_format}").relative_to(out_dir))
        save_png(images[i, 0], out_dir / record["image"])
    else:
        save_png(images[i], out_dir / record["image"])
    record.update({n: e["scores"][i] for n, e in scored.items()})
    record.update({f"{n}/correct": e["correct"][i] for n, e in scored.items() if "correct" in e})
    return record
