"""experiments/time_to_target.py: the paired held-out accuracy change of each checkpoint, the seeds' mean per epoch and
the first epoch reaching the target, checked on hand-made run folders (their checkpoints' evaluations already written,
so no sampling runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))  # experiments/time_to_target.py
from time_to_target import main


def _samples(path: Path, variant_verdicts: dict[str, list[bool]]) -> None:
    rows = [{"variant": variant, "prompt_index": i // 2, "seed": i % 2, "geneval_shapes/correct": ok}
            for variant, verdicts in variant_verdicts.items() for i, ok in enumerate(verdicts)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(folder: Path, base: list[bool], at_epoch_2: list[bool], final: list[bool]) -> str:
    """4 epochs, 2 optimizer steps each: checkpoint-4 is epoch 2 (scored in eval_checkpoint-4), checkpoint-8 = final."""
    _samples(folder / "eval" / "samples.jsonl", {"base": base, "finetuned": final})
    _samples(folder / "eval_checkpoint-4" / "samples.jsonl", {"checkpoint": at_epoch_2})
    (folder / "eval_checkpoint-4" / "metrics.json").write_text("{}")
    for step in (4, 8):
        (folder / f"checkpoint-{step}").mkdir()
    (folder / "history.jsonl").write_text("".join(
        json.dumps({"epoch": e, "step": 2 * e, "train_seconds": 10.0 * e, "rollouts": 64 * e}) + "\n"
        for e in range(1, 5)))
    return str(folder)


def test_changes_per_checkpoint_and_the_epoch_reaching_the_target(tmp_path, capsys):
    base = [False, False, True, True]
    a = _run(tmp_path / "a", base, [True, False, True, True], [True, True, True, True])   # +0.25, then +0.50
    b = _run(tmp_path / "b", base, [False, False, True, False], [True, False, True, True])  # -0.25, then +0.25
    assert main(["--label", "m", a, b, "--target", "0.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    per_run = [line.split("\t") for line in lines[1:5]]
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in per_run] == [
        ("a", "2", "20", "128", "+0.2500"), ("a", "4", "40", "256", "+0.5000"),
        ("b", "2", "20", "128", "-0.2500"), ("b", "4", "40", "256", "+0.2500")]
    means = {line.split("\t")[1]: line.split("\t") for line in lines if line.startswith("m\t") and
             len(line.split("\t")) == 6}
    assert means["2"][4] == "+0.0000" and means["4"][4] == "+0.3750"  # (0.25 - 0.25) / 2, (0.5 + 0.25) / 2
    assert means["4"][5] == "0.1250"  # s.e. over the two seeds: |0.5 - 0.25| / 2
    assert lines[-1] == "m: target reached at epoch 4 (40 s of training)"
