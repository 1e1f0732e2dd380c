"""experiments/verifier_drift_table.py --by-tag: the paired accuracy change per prompt tag, pooled over runs and
against controls, checked on hand-made evaluation files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "experiments"))  # experiments/verifier_drift_table.py
from verifier_drift_table import by_tag, prompt_clustered


def _run(folder: Path, changes: dict[str, list[tuple[bool, bool]]]) -> str:
    """A run folder whose eval/samples.jsonl has, per tag, images (base correct, fine-tuned correct)."""
    rows, index = [], 0
    for tag, images in changes.items():
        for base_ok, ft_ok in images:
            for variant, ok in (("base", base_ok), ("finetuned", ft_ok)):
                rows.append({"variant": variant, "prompt": f"p{index}", "seed": 0, "prompt_index": index, "tag": tag,
                             "image": f"images/{variant}/{index}.png", "geneval_shapes": float(ok),
                             "geneval_shapes/correct": ok})
            index += 1
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(folder)


def _table(out: str) -> dict[str, list[str]]:
    return {line.split("\t")[0]: line.split("\t")[1:] for line in out.splitlines()[2:]}


def test_by_tag_pools_runs_and_subtracts_controls(tmp_path, capsys):
    # run a: position 2 of 4 images gained (+0.5), counting 1 of 2 lost (−0.5); all: (2 − 1) / 6
    a = _run(tmp_path / "a", {"position": [(False, True), (False, True), (True, True), (False, False)],
                              "counting": [(True, False), (True, True)]})
    # run b: position 0 gained (0.0), counting 1 of 2 gained (+0.5); all: 1 / 6
    b = _run(tmp_path / "b", {"position": [(True, True)] * 4, "counting": [(False, True), (True, True)]})
    # control: position 1 of 4 lost (−0.25), counting unchanged; all: −1 / 6
    c = _run(tmp_path / "c", {"position": [(True, False), (True, True), (True, True), (True, True)],
                              "counting": [(True, True), (False, False)]})
    by_tag([a, b], controls=[c])
    rows = _table(capsys.readouterr().out)
    assert rows["position"][:2] == ["4", "+0.2500"]  # mean of +0.5 and 0.0
    assert rows["position"][2] == "0.2500"  # s.e. over 2 runs: |0.5 − 0| / 2
    assert rows["position"][3] == "-0.2500" and rows["position"][5] == "+0.5000"  # control, difference
    assert rows["counting"][:3] == ["2", "+0.0000", "0.5000"]  # (−0.5 + 0.5) / 2; s.e. |−0.5 − 0.5| / 2
    assert rows["all"][:2] == ["6", "+0.1667"]  # (1/6 + 1/6) / 2
    assert rows["all"][5] == "+0.3333"  # 1/6 − (−1/6)
    assert rows["position"][4] == "nan"  # one control: no s.e. over controls


def test_by_tag_without_a_verifier_evaluation_says_so(tmp_path, capsys):
    by_tag([str(tmp_path / "missing")])
    assert "no run with a verifier evaluation" in capsys.readouterr().out


def test_failures_counts_each_kind_of_failed_constraint_once_per_image(tmp_path, capsys):
    from PIL import Image
    from verifier_drift_table import failures

    from diffalign.world.prompts import all_prompts
    from diffalign.world.render import render_spec

    spec = next(r for r in all_prompts()["heldout"] if r["tag"] == "position")
    folder = tmp_path / "run" / "eval"
    (folder / "images").mkdir(parents=True)
    rows = []
    # base: a correct render; fine-tuned: a blank image (both objects missing: every count, colour and the relation
    # fail, so one image each for count, color, position; nothing extra)
    for variant, image in (("base", render_spec(spec, seed=0)), ("finetuned", render_spec(spec, seed=0) * 0 + 255)):
        Image.fromarray(image.astype("uint8")).save(folder / "images" / f"{variant}.png")
        rows.append({"variant": variant, "prompt": spec["prompt"], "seed": 0, "prompt_index": 0, "tag": "position",
                     "image": f"images/{variant}.png"})
    (folder / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    failures([str(tmp_path / "run")], "position")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == ["run", "variant", "images", "wrong", "count", "color", "position", "no_extra"]
    assert lines[1].split("\t") == ["run", "base", "1", "0", "0", "0", "0", "0"]
    assert lines[2].split("\t") == ["run", "finetuned", "1", "1", "1", "1", "1", "0"]
    failures([str(tmp_path / "run")], "counting")  # no image of that tag: no rows
    assert capsys.readouterr().out.count("\n") == 1


def test_prompt_clustered_se_by_hand():
    """Two runs, 3 prompts x 2 seeds. Run-averaged per image: p0 (1, 1), p1 (0, 0.5), p2 (0, -0.5): prompt means 1,
    0.25, -0.25, mean 1/3, stdev √(((2/3)² + (1/12)² + (7/12)²) / 2) = √(0.7917 / 2) = 0.6292, s.e. 0.6292 / √3 =
    0.3632, ratio 0.9."""
    a = {"p0_s0": 1.0, "p0_s1": 1.0, "p1_s0": 0.0, "p1_s1": 1.0, "p2_s0": 0.0, "p2_s1": 0.0}
    b = {"p0_s0": 1.0, "p0_s1": 1.0, "p1_s0": 0.0, "p1_s1": 0.0, "p2_s0": 0.0, "p2_s1": -1.0}
    assert prompt_clustered([a, b]) == "clustered by prompt (3 prompts): +0.3333 ± 0.3632 (0.9)"
