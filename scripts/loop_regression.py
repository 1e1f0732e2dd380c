"""Bit-for-bit regression record of the two training loops (a maintenance tool for refactors of diffalign/train/).

Runs every tiny recipe for a few updates with a fixed seed and writes, per case, the logged history (without wall-clock
fields) and a SHA-256 of the final LoRA tensors. Record before a refactor, check after it:

    OMP_NUM_THREADS=1 python scripts/loop_regression.py --record /tmp/loops.json
    OMP_NUM_THREADS=1 python scripts/loop_regression.py --check /tmp/loops.json [--only tiny_dgpo,...]

``--check`` exits with status 1 and names every case whose history or weights differ, with the largest difference of
its logged numbers. ``--lora-dir DIR`` keeps each case's final LoRA as ``DIR/<case>.safetensors`` (to measure how far
two runs' weights are apart: ``--compare-lora DIR_A DIR_B``); ``--set KEY=VALUE`` adds overrides to the online cases
(e.g. ``--set online.fuse_rollout_lora=false``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from safetensors.torch import load_file

from diffalign.config.compose import CONFIG_DIR, setup_hydra

ONLINE = ["online.num_epochs=2", "online.groups_per_epoch=2", "online.group_size=4", "online.rollout_batch_size=8",
          "online.checkpointing_epochs=1", "trainer.batch_size=8", "sampler.num_inference_steps=4"]
OFFLINE = ["trainer.max_steps=3", "trainer.batch_size=2", "trainer.checkpointing_steps=2"]
COMMON = ["eval.enabled=false", "trainer.log_with=none", "trainer.keep_last=-1", "seed=3"]
DGPO = ["method.timestep_max_index=2", "method.timesteps_per_epoch=2", "method.old_policy_switch_step=1"]

# (loop, overrides); `{tmp}` is the case's scratch folder
CASES: dict[str, tuple[str, list[str]]] = {
    "tiny_ddpo": ("online", ["recipe=tiny_ddpo", "online.tracker_min_count=2", *ONLINE]),
    "tiny_flow_grpo": ("online", ["recipe=tiny_flow_grpo", *ONLINE]),
    "tiny_flow_grpo_best_of_n": ("online", ["recipe=tiny_flow_grpo", "online.best_of_n=2", "online.num_inner_epochs=2",
                                            *ONLINE]),
    "tiny_dgpo": ("online", ["recipe=tiny_dgpo", *DGPO, *ONLINE]),
    "tiny_dgpo_tiny_sd": ("online", ["recipe=tiny_dgpo", "model=tiny_sd", *DGPO, *ONLINE]),
    "tiny_dgpo_ema_reference": ("online", ["recipe=tiny_dgpo", "reference=ema", "reference.decay=0.5", *DGPO,
                                           *ONLINE]),
    "tiny_vipo_image": ("online", ["recipe=tiny_vipo_image", *ONLINE]),
    "tiny_vipo_image_per_reward": ("online", ["recipe=tiny_vipo_image", "reward=[geneval_shapes,brightness]",
                                              "method.advantage_per_reward=true", *ONLINE]),
    "tiny_vipo_wan": ("online", ["recipe=tiny_vipo_wan", *ONLINE]),
    "tiny_diffusion_nft": ("online", ["recipe=tiny_diffusion_nft", *ONLINE]),
    "tiny_dpo": ("preference", ["recipe=tiny_dpo", "data.num_prompts=2", "data.samples_per_prompt=2",
                                "data.sampler.num_inference_steps=4", *OFFLINE]),
    "tiny_dpo_ema_accumulation": ("preference", ["recipe=tiny_dpo", "data.num_prompts=2", "data.samples_per_prompt=2",
                                                 "data.sampler.num_inference_steps=4", "reference=ema", "reference.decay=0.5",
                                                 "trainer.gradient_accumulation_steps=2", *OFFLINE]),
    "tiny_dpo_sft": ("preference", ["recipe=tiny_dpo", "method=sft", "data=shapes_winners", "data.num_samples=8",
                                    *OFFLINE]),
    "tiny_seppo": ("preference", ["recipe=tiny_seppo", "data.num_samples=8", "sampler.num_inference_steps=4",
                                  "reference.save_every=1", "reference.keep=2", *OFFLINE]),
    "tiny_ddspo": ("preference", ["recipe=tiny_ddspo", "data.pairs_dir={tmp}/pairs", "data.prompts={tmp}/prompts.txt",
                                  "data.max_pairs=4", "data.num_inference_steps=4", "data.batch_size=4", *OFFLINE]),
}
WALL_CLOCK = ("epoch_seconds", "train_seconds")


def run_case(name: str, root: Path, extra: list[str] = (), lora_dir: Path | None = None) -> dict:
    """Trains case `name` in `root/name` (`extra`: overrides added to an online case); returns its history (no
    wall-clock fields) and final-LoRA digest; copies the final LoRA to ``lora_dir/<name>.safetensors`` if given."""
    loop, overrides = CASES[name]
    overrides = overrides + (list(extra) if loop == "online" else [])
    tmp = root / name
    tmp.mkdir(parents=True)
    (tmp / "prompts.txt").write_text("a red circle\na blue square\na green triangle\na yellow circle\n")
    overrides = [o.replace("{tmp}", str(tmp)) for o in overrides] + COMMON + [f"output_dir={tmp / 'run'}"]
    setup_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    if loop == "online":
        from diffalign.train.online import train
    else:
        from diffalign.train.preference import train
    results = train(cfg)
    if loop == "online":
        history = [json.loads(line) for line in (tmp / "run" / "history.jsonl").read_text().splitlines()]
    else:
        history = results["history_tail"]
    history = [{k: v for k, v in h.items() if k not in WALL_CLOCK} for h in history]
    lora = load_file(tmp / "run" / "final" / "pytorch_lora_weights.safetensors")
    if lora_dir is not None:
        lora_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp / "run" / "final" / "pytorch_lora_weights.safetensors", lora_dir / f"{name}.safetensors")
    digest = hashlib.sha256()
    for key in sorted(lora):
        digest.update(key.encode())
        digest.update(lora[key].float().numpy().tobytes())
    return {"history": history, "lora_sha256": digest.hexdigest(), "global_step": results["global_step"]}


def max_difference(want, got, path: str = "") -> tuple[float, str]:
    """The largest |Δ| between the numbers of two records (histories) and where it is: ``(inf, path)`` where their
    structure or a non-number differs."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(want) != set(got):
            return float("inf"), f"{path}: keys {sorted(set(want) ^ set(got))}"
        pairs = [(want[k], got[k], f"{path}.{k}") for k in want]
    elif isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return float("inf"), f"{path}: {len(want)} vs {len(got)} entries"
        pairs = [(a, b, f"{path}[{i}]") for i, (a, b) in enumerate(zip(want, got))]
    elif isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(want, bool):
        return abs(float(want) - float(got)), path
    else:
        return (0.0, path) if want == got else (float("inf"), f"{path}: {want!r} vs {got!r}")
    return max((max_difference(a, b, p) for a, b, p in pairs), default=(0.0, path), key=lambda d: d[0])


def compare_loras(dir_a: Path, dir_b: Path) -> None:
    """Prints, per case present in both folders, the largest |Δ| of the final LoRA tensors and the largest |value|."""
    for file in sorted(dir_a.glob("*.safetensors")):
        if not (dir_b / file.name).exists():
            continue
        a, b = load_file(file), load_file(dir_b / file.name)
        delta = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        scale = max(float(a[k].float().abs().max()) for k in a)
        print(f"{file.stem}: max |delta LoRA| = {delta:.3g} (max |LoRA| {scale:.3g})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path)
    mode.add_argument("--check", type=Path)
    mode.add_argument("--compare-lora", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    parser.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override added to every online case (repeatable)")
    parser.add_argument("--lora-dir", type=Path, default=None, help="keep each case's final LoRA here")
    args = parser.parse_args()
    if args.compare_lora:
        compare_loras(*args.compare_lora)
        return 0
    names = args.only.split(",") if args.only else list(CASES)
    with tempfile.TemporaryDirectory() as root:
        got = {name: run_case(name, Path(root), args.set, args.lora_dir) for name in names}
    if args.record:
        args.record.write_text(json.dumps(got, indent=1))
        print(f"recorded {len(got)} cases to {args.record}")
        return 0
    want = json.loads(args.check.read_text())
    new = [n for n in names if n not in want]
    bad = [n for n in names if n in want and json.loads(json.dumps(got[n])) != want[n]]
    for n in bad:
        delta, where = max_difference(want[n]["history"], json.loads(json.dumps(got[n]["history"])))
        lora = "same" if want[n]["lora_sha256"] == got[n]["lora_sha256"] else "differs"
        print(f"DIFFERS: {n}: max |delta| of the history {delta:.3g} (at {where}); final LoRA {lora}"
              f"\n  want {want[n]}\n  got  {got[n]}")
    for n in new:
        print(f"NEW: {n} (not in {args.check})")
    print(f"{len(names) - len(bad) - len(new)}/{len(names) - len(new)} cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
