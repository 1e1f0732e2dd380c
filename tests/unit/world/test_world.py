"""The shapes world: renderer, prompts, verifier."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from diffalign.rewards.geneval_shapes import GenevalShapes
from diffalign.world.prompts import TAGS, all_prompts, load_prompts
from diffalign.world.render import SceneObject, caption, corrupt_spec, render, render_spec, scene_from_spec, to_tensor
from diffalign.world.tokenizer import build_tokenizer
from diffalign.world.verifier import detect, parse_caption, verify

ALL = all_prompts()
ROWS = ALL["train"] + ALL["heldout"]


def test_renderer_is_deterministic_in_seed():
    spec = parse_caption("a red circle left of a green triangle")
    a, b, c = render_spec(spec, 5), render_spec(spec, 5), render_spec(spec, 6)
    assert a.shape == (32, 32, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_render_pixels_by_hand():
    # square centred at (10, 12), r=4: corners 10 ± 3.4 and 12 ± 3.4; PIL truncates float corners (int(6.6) = 6)
    # and fills inclusively, so x spans 6..13 and y 8..15
    img = render([SceneObject("square", "red", 10, 12, 4, (200, 10, 10))])
    ys, xs = np.nonzero(img.max(-1))
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (6, 13, 8, 15)
    assert tuple(img[12, 10]) == (200, 10, 10) and tuple(img[0, 0]) == (0, 0, 0)


def test_captions_and_metadata_agree():
    for row in ROWS:
        assert caption(row) == row["prompt"]
        assert parse_caption(row["prompt"]) == row
    assert parse_caption("two blue squares") == {
        "tag": "counting",
        "prompt": "two blue squares",
        "include": [{"class": "square", "count": 2, "color": "blue"}],
    }
    # GenEval's position convention: the subject carries ["relation", anchor index]
    assert parse_caption("a red circle above a green triangle")["include"] == [
        {"class": "triangle", "count": 1, "color": "green"},
        {"class": "circle", "count": 1, "color": "red", "position": ["above", 0]},
    ]
    with pytest.raises(ValueError, match="not a shapes-world prompt"):
        parse_caption("a photo of a dog")


def test_splits_disjoint_cover_every_tag_and_hold_out_pairs():
    train = {r["prompt"] for r in ALL["train"]}
    held = {r["prompt"] for r in ALL["heldout"]}
    assert not train & held
    assert {r["tag"] for r in ALL["heldout"]} == set(TAGS)
    # a held-out object pair never appears together in a train caption
    held_pairs = {
        frozenset((e["color"], e["class"]) for e in r["include"])
        for r in ALL["heldout"]
        if r["tag"] in ("color_attr", "position")
    }
    for r in ALL["train"]:
        if r["tag"] in ("color_attr", "position"):
            assert frozenset((e["color"], e["class"]) for e in r["include"]) not in held_pairs
    assert len(held_pairs) == 10
    assert load_prompts("heldout") == ALL["heldout"]


def test_scene_satisfies_spec_geometry():
    spec = parse_caption("a blue square below a yellow circle")
    for seed in range(50):
        objs = scene_from_spec(spec, seed)
        anchor = next(o for o in objs if o.shape == "circle")
        subj = next(o for o in objs if o.shape == "square")
        assert subj.cy - anchor.cy >= 6 and subj.cy - anchor.cy > abs(subj.cx - anchor.cx)


def test_verifier_on_ground_truth_renders_per_tag():
    rng = np.random.default_rng(0)
    by_tag = defaultdict(list)
    for tag in TAGS:
        rows = [r for r in ROWS if r["tag"] == tag]
        for k in range(200):
            row = rows[rng.integers(len(rows))]
            by_tag[tag].append(verify(render_spec(row, 1000 + k), row).correct)
    for tag, oks in by_tag.items():
        assert np.mean(oks) >= 0.99, (tag, np.mean(oks))


@pytest.mark.parametrize(
    "prompt,wrong,failed",
    [
        ("a red circle", "a green circle", "color/0"),
        ("two blue squares", "three blue squares", "count/0"),
        ("a yellow triangle", "a yellow square", "count/0"),
        ("a red circle left of a green triangle", "a red circle right of a green triangle", "position/1"),
        ("a circle and a square", "a circle and a triangle", "count/1"),
    ],
)
def test_verifier_rejects_other_scenes_naming_the_failed_constraint(prompt, wrong, failed):
    spec = parse_caption(prompt)
    for seed in range(20):
        verdict = verify(render_spec(parse_caption(wrong), seed), spec)
        assert not verdict.correct
        assert failed in verdict.failed
        assert 0.0 <= verdict.score < 1.0


def test_verifier_counts_extra_objects_and_dense_score():
    spec = parse_caption("a red circle")
    img = render(
        [SceneObject("circle", "red", 8, 8, 5, (220, 40, 40)), SceneObject("square", "blue", 24, 24, 5, (50, 90, 235))]
    )
    v = verify(img, spec)
    # constraints: count/0 ok, color/0 ok, no_extra fails -> 2/3
    assert v.failed == ["no_extra"] and v.score == pytest.approx(2 / 3)
    assert [(d.shape, d.color) for d in detect(img)] == [("circle", "red"), ("square", "blue")]


def test_corrupted_specs_always_fail():
    for i, row in enumerate(ROWS[::7]):
        bad, kind = corrupt_spec(row, i)
        assert bad != row
        assert not verify(render_spec(bad, i), row).correct, (row["prompt"], kind)


def test_reward_matches_verifier_and_is_batch_independent():
    reward = GenevalShapes()
    rows = ROWS[::60]
    imgs = to_tensor(np.stack([render_spec(r, i) for i, r in enumerate(rows)]))
    imgs[0] = 0  # an empty image fails its prompt
    out = reward(imgs, [r["prompt"] for r in rows])
    assert out.scores.dtype == torch.float32 and out.scores.shape == (len(rows),)
    assert not out.info["correct"][0] and out.info["correct"][1:].all()
    single = reward(imgs[3:4], [rows[3]["prompt"]])
    assert torch.equal(single.scores, out.scores[3:4])
    binary = GenevalShapes(score="binary")(imgs, [r["prompt"] for r in rows])
    assert torch.equal(binary.scores, out.info["correct"].float())
    with pytest.raises(ValueError, match="one per image"):
        reward(imgs, ["a red circle"])


def test_tokenizer_roundtrip():
    tok = build_tokenizer()
    ids = tok("a red circle left of a green triangle", padding="max_length", max_length=12).input_ids
    assert len(tok) == 23 and ids[0] == tok.bos_token_id and ids[9] == tok.eos_token_id and ids[10:] == [0, 0]
    assert tok.decode(ids, skip_special_tokens=True) == "a red circle left of a green triangle"


def test_wide_margins_keep_every_object_off_the_verifiers_thresholds():
    from diffalign.world.edges import edge_flips
    from diffalign.world.render import DEFAULT_MARGINS, WIDE_MARGINS, relation_holds

    rows = ALL["train"][::6]
    for i, row in enumerate(rows):
        objects = scene_from_spec(row, i, margins=WIDE_MARGINS)
        assert min(o.r for o in objects) >= 4
        for a in range(len(objects)):
            for b in range(a + 1, len(objects)):
                (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = objects[a].bbox(), objects[b].bbox()
                assert max(bx0 - ax1, ax0 - bx1, by0 - ay1, ay0 - by1) > 3
        if row["tag"] == "position":
            rel, _ = row["include"][1]["position"]
            subj = next(o for o in objects if o.shape == row["include"][1]["class"]
                        and o.color == row["include"][1].get("color", o.color))
            anch = next(o for o in objects if o is not subj)
            assert relation_holds(subj, anch, rel, 8)
    # the default margins are the world as it always was: the same scene for the same seed
    assert scene_from_spec(rows[0], 3) == scene_from_spec(rows[0], 3, margins=DEFAULT_MARGINS)
    wide = [render_spec(r, i, margins=WIDE_MARGINS) for i, r in enumerate(rows)]
    assert edge_flips(wide, rows).n_flipped == 0


def test_antialiased_render_blends_edges_and_keeps_the_coverage():
    obj = [SceneObject("circle", "red", 15, 15, 6, (200, 0, 0))]
    hard, soft = render(obj), render(obj, antialias=4)
    assert np.array_equal(render(obj, antialias=1), hard)
    red = soft[..., 0].astype(int)
    assert ((red > 0) & (red < 200)).sum() > 10  # blended edge pixels
    # the covered area: a disc of diameter 13 px (bbox 9..21 inclusive) has area pi * 6.5^2 = 132.7 px
    assert red.sum() / 200 == pytest.approx(np.pi * 6.5 ** 2, rel=0.05)
    with pytest.raises(ValueError, match="antialias"):
        render(obj, antialias=0)
