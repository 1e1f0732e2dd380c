"""Preference and winner data loaders: Pick-a-Pic layout (ties and winner order,
docs/guides/field_cases.md#preference-ties-and-winner-order), winner folders, shapes-world winners, image decoding, RGB
conversion, resize/center-crop, corrupt files, and a Diffusion-DPO run that reads Pick-a-Pic rows."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import colour_of, compose_cfg, png_bytes
from PIL import Image

from diffalign.data.images import load_image
from diffalign.data.pickapic import PickAPicPairs
from diffalign.data.shapes_pairs import ShapesPairs
from diffalign.data.winners import ShapesWinners, WinnerFolder

# row i: image 0 = colour A_i, image 1 = colour B_i (8x8 solid colours)
A = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
B = [(0, 255, 255), (255, 0, 255), (128, 128, 128), (255, 255, 255)]


def write_table(tmp_path: Path, labels, as_paths: bool = True) -> Path:
    rows = []
    for i, label in enumerate(labels):
        row = {"caption": f"prompt {i}", "label_0": label, "label_1": 1 - label}
        for j, colours in enumerate((A, B)):
            data = png_bytes(colours[i])
            if as_paths:
                (tmp_path / f"{i}_{j}.png").write_bytes(data)
                row[f"jpg_{j}"] = f"{i}_{j}.png"
            else:
                row[f"jpg_{j}"] = {"bytes": base64.b64encode(data).decode()}
        rows.append(row)
    path = tmp_path / "pickapic.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("as_paths", [True, False])
def test_pickapic_drops_ties_and_puts_the_winner_first(tmp_path, as_paths):
    data = PickAPicPairs(str(write_table(tmp_path, [1, 0, 0.5, 1], as_paths)), resolution=8)
    assert len(data) == 3 and data.num_ties == 1 and data.num_ties_dropped == 1
    prompt, image_w, image_l, row = data[1]  # the second row, label_0 = 0: image 1 wins
    assert (prompt, row) == ("prompt 1", 1)
    assert colour_of(image_w) == B[1] and colour_of(image_l) == A[1]
    prompt, image_w, image_l, row = data[0]
    assert colour_of(image_w) == A[0] and colour_of(image_l) == B[0]
    assert [data[i][3] for i in range(3)] == [0, 1, 3]  # the tie (row 2) is gone
    batch = data.collate([0, 1, 2])
    assert batch["images_w"].shape == (3, 3, 8, 8) and batch["ids"].tolist() == [0, 1, 3]


@pytest.mark.parametrize("label", [0.3, 2])
def test_pickapic_bad_label_raises_naming_the_row(tmp_path, label):
    with pytest.raises(ValueError, match=r"row 1 .*label_0="):
        PickAPicPairs(str(write_table(tmp_path, [1, label, 0.5, 1])))


def test_inconsistent_label_1_and_missing_field_raise(tmp_path):
    path = write_table(tmp_path, [1, 0])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["label_1"] = 0.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match="row 1.*do not sum to 1"):
        PickAPicPairs(str(path))
    del rows[0]["jpg_1"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) lacks fields \['jpg_1'\]"):
        PickAPicPairs(str(path))


def test_keep_ties_never_become_wins(tmp_path):
    data = PickAPicPairs(str(write_table(tmp_path, [0.5, 0.5, 1])), keep_ties=True)
    assert len(data) == 1 and data.num_ties == 2 and data.num_ties_dropped == 0


def test_winners_only_reads_no_loser(tmp_path):
    path = write_table(tmp_path, [1, 0, 0.5, 1])
    (tmp_path / "1_0.png").write_bytes(b"not a png")  # row 1's loser is corrupt, and never read
    batch = PickAPicPairs(str(path), resolution=8, winners_only=True).collate([0, 1])
    assert "images_l" not in batch and colour_of(batch["images_w"][1]) == B[1]


def test_corrupt_image_names_the_file_and_row(tmp_path):
    path = write_table(tmp_path, [1, 0])
    (tmp_path / "1_1.png").write_bytes(png_bytes(B[1])[:40])  # truncated
    data = PickAPicPairs(str(path), resolution=8)
    with pytest.raises(ValueError, match=r"pickapic.jsonl row 1 .*jpg_1.*1_1.png.*corrupt"):
        data[1]
    (tmp_path / "1_1.png").unlink()
    with pytest.raises(ValueError, match="1_1.png.*does not exist"):
        data[1]


def test_parquet_input(tmp_path):
    # image 0 as plain binary, image 1 as the Hugging Face `Image` struct {"bytes", "path"}
    rows = [{"caption": f"prompt {i}", "jpg_0": png_bytes(A[i]), "jpg_1": {"bytes": png_bytes(B[i]), "path": None},
             "label_0": label, "label_1": 1 - label} for i, label in enumerate([1, 0, 0.5, 1])]
    path = tmp_path / "train-00000.parquet"
    if importlib.util.find_spec("pyarrow") is None:
        path.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            PickAPicPairs(str(path))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    data = PickAPicPairs(str(tmp_path), resolution=8)  # a folder of shards
    assert len(data) == 3 and data.num_ties == 1
    _, image_w, image_l, _ = data[1]
    assert colour_of(image_w) == B[1] and colour_of(image_l) == A[1]


def test_rgb_conversion_and_center_crop(tmp_path):
    for mode in ("L", "RGBA", "P", "CMYK"):
        image = load_image(png_bytes((200, 200, 200), mode=mode if mode != "CMYK" else "RGB"), "x", 4)
        assert image.shape == (3, 4, 4) and image.dtype == torch.float32
    cmyk = io.BytesIO()
    Image.new("CMYK", (6, 6), (0, 0, 0, 0)).save(cmyk, format="JPEG")
    assert load_image(cmyk.getvalue(), "x", 6).shape == (3, 6, 6)
    # 16x8 (W x H): columns 0-3 red, 4-11 green, 12-15 blue; shorter side is already 8 -> center crop = green only
    array = np.zeros((8, 16, 3), dtype=np.uint8)
    array[:, :4] = (255, 0, 0)
    array[:, 4:12] = (0, 255, 0)
    array[:, 12:] = (0, 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    cropped = load_image(buffer.getvalue(), "x", 8)
    assert cropped.shape == (3, 8, 8) and torch.equal(cropped, torch.tensor([0.0, 1.0, 0.0]).view(3, 1, 1).expand(3, 8, 8))
    upscaled = load_image(png_bytes((10, 20, 30), size=(4, 4)), "x", 32)
    assert upscaled.shape == (3, 32, 32) and colour_of(upscaled) == (10, 20, 30)
    with pytest.raises(TypeError, match="unsupported image value"):
        load_image(3.0, "row 9", 8)


def test_winner_folder(tmp_path):
    (tmp_path / "img").mkdir()
    for i in range(3):
        (tmp_path / "img" / f"{i}.png").write_bytes(png_bytes(A[i], size=(12, 10)))
    captions = tmp_path / "metadata.jsonl"
    captions.write_text("".join(json.dumps({"file_name": f"img/{i}.png", "caption": f"c{i}"}) + "\n" for i in range(3)))
    data = WinnerFolder(str(captions), resolution=8)
    batch = data.collate([2, 0])
    assert batch["prompts"] == ["c2", "c0"] and batch["images_w"].shape == (2, 3, 8, 8)
    assert colour_of(batch["images_w"][0]) == A[2] and batch["ids"].tolist() == [2, 0]
    (tmp_path / "img" / "1.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ValueError, match=r"metadata.jsonl line 2 'img/1.png'.*corrupt"):
        data[1]
    captions.write_text('{"file_name": "img/0.png"}\n')
    with pytest.raises(ValueError, match=r"line 1 lacks \['caption'\]"):
        WinnerFolder(str(captions))


def test_shapes_winners_are_the_shapes_pairs_winners():
    winners, pairs = ShapesWinners(num_samples=6, seed=3), ShapesPairs(num_pairs=6, seed=3)
    for i in range(6):
        assert winners[i]["prompt"] == pairs[i]["prompt"]
        assert torch.equal(winners[i]["image_w"], pairs[i]["image_w"])
    batch = winners.collate([4, 1])
    assert batch["images_w"].shape == (2, 3, 32, 32) and "images_l" not in batch


def test_diffusion_dpo_trains_on_pickapic_rows(tmp_path):

    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    path = write_table(tmp_path, [1, 0, 0.5, 1])  # 8x8 images, resized to the tiny model's 32 px
    overrides = [f"output_dir={tmp_path / 'run'}", "model=tiny_random", "data=pickapic", f"data.path={path}",
                 "trainer.max_steps=1", "trainer.batch_size=2", "trainer.log_with=none", "eval.enabled=false"]
    cfg = compose_cfg(overrides)
    validate_train_config(cfg)
    results = train(cfg)
    assert results["global_step"] == 1 and np.isfinite(results["history_tail"][0]["loss"])
    with pytest.raises(ValueError, match="data.path"):
        validate_train_config(compose_cfg(overrides[:2] + ["data=pickapic"]))
    with pytest.raises(ValueError, match="data.resolution=32"):
        train(compose_cfg(overrides + ["data.resolution=8", f"output_dir={tmp_path / 'run2'}"]))
