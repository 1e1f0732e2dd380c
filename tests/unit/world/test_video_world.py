"""The tiny world's video variant (renderer, captions, motion verifier) and the video rewards (per-frame, temporal
consistency, motion)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffalign.rewards.reward_set import build_reward
from diffalign.rewards.video import PerFrame, TemporalConsistency, VideoMotion
from diffalign.types import RewardOutput
from diffalign.world.prompts import load_prompts
from diffalign.world.render import render_spec, to_tensor
from diffalign.world.video import (
    all_video_prompts,
    direction_sign,
    parse_video_caption,
    render_video,
    verify_video,
    video_caption,
    videos_to_tensor,
)


def test_ground_truth_videos_pass_the_motion_verifier_and_captions_round_trip():
    rows = load_prompts("video_train") + load_prompts("video_heldout")
    assert len(rows) == 140 and {r["tag"] for r in rows} == {"motion", "two_motion"}
    assert not {r["prompt"] for r in load_prompts("video_train")} & {r["prompt"] for r in load_prompts("video_heldout")}
    for i, row in enumerate(rows):
        spec = parse_video_caption(row["prompt"])
        assert video_caption(spec) == row["prompt"]
        for seed in (i, i + 1000):
            video = render_video(row, seed)
            assert video.shape == (8, 32, 32, 3)
            verdict = verify_video(video, spec)
            assert verdict.correct, (row["prompt"], verdict.constraints)
    assert np.array_equal(render_video(rows[0], 3), render_video(rows[0], 3))


@pytest.mark.parametrize("motion", ["left", "right", "up", "down", "still"])
def test_the_verifier_rejects_every_other_direction(motion):
    spec = parse_video_caption(f"a red circle {'staying still' if motion == 'still' else 'moving ' + motion}")
    video = render_video(spec, seed=5)
    for other in ["left", "right", "up", "down", "still"]:
        o = parse_video_caption(f"a red circle {'staying still' if other == 'still' else 'moving ' + other}")
        verdict = verify_video(video, o)
        assert verdict.constraints["motion/0"] == (other == motion)
        assert verdict.constraints["identity/0"]


def test_direction_sign_by_hand():
    spec = parse_video_caption("a red circle moving left and a blue square moving up")
    # left: x falls by 6 px, y drifts 2 px -> right way; up: y falls by 3 px but x moves 4 px -> across dominates
    tracks = [[(20.0, 10.0), (17.0, 11.0), (14.0, 12.0)], [(8.0, 20.0), (10.0, 19.0), (12.0, 17.0)]]
    assert direction_sign(tracks, spec) == [True, False]
    # the wrong way along the named axis, a track with a missing frame (skipped), and a still entry (skipped)
    assert direction_sign([[(14.0, 10.0), (20.0, 10.0)], [(8.0, 20.0), None]], spec) == [False]
    still = parse_video_caption("a red circle staying still and a blue square moving down")
    assert direction_sign([[(5.0, 5.0), (5.0, 5.0)], [(8.0, 10.0), (8.0, 14.0)]], still) == [True]
    # ground truth: every moving object of a rendered video points the named way
    for motion in ("left", "right", "up", "down"):
        s = parse_video_caption(f"a green triangle moving {motion}")
        assert direction_sign(verify_video(render_video(s, seed=3), s).tracks, s) == [True]


def test_identity_must_be_kept_across_frames():
    spec = parse_video_caption("a red circle staying still")
    video = render_video(spec, seed=1)
    morphed = video.copy()
    square = render_spec({"tag": "colors", "include": [{"class": "square", "count": 1, "color": "red"}]}, seed=1)
    morphed[4:] = square  # the circle turns into a square half way
    v = verify_video(morphed, spec)
    assert not v.constraints["identity/0"] and not v.correct
    vanished = video.copy()
    vanished[3] = 0  # the object disappears for one frame
    v = verify_video(vanished, spec)
    assert not v.constraints["identity/0"] and not v.constraints["motion/0"]
    wrong_colour = verify_video(video, parse_video_caption("a blue circle staying still"))
    assert wrong_colour.score < 1


def hand_built_video() -> torch.Tensor:
    """4 frames: a red circle in frames 0-1, a blue square in frames 2-3."""
    circle = render_spec({"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}]}, seed=0)
    square = render_spec({"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}]}, seed=0)
    return to_tensor(np.stack([circle, circle, square, square]))  # (4, 3, 32, 32)


def test_per_frame_reward_reads_frames_in_time_order_with_an_explicit_layout():
    video = hand_built_video()[None]  # (1, F=4, 3, 32, 32)
    # "a red circle" on a blue-square frame: count/0 and color/0 fail, no_extra holds -> 1/3
    mean = PerFrame("geneval_shapes", aggregate="mean")(video, ["a red circle"])
    torch.testing.assert_close(mean.info["per_frame"], torch.tensor([[1.0, 1.0, 1 / 3, 1 / 3]]))
    torch.testing.assert_close(mean.scores, torch.tensor([2 / 3]))
    low = PerFrame("geneval_shapes", aggregate="min", layout="BCFHW")(video.transpose(1, 2), ["a red circle"])
    torch.testing.assert_close(low.scores, torch.tensor([1 / 3]))
    torch.testing.assert_close(low.info["per_frame"], mean.info["per_frame"])

    class FrameIndexReward:  # score = mean brightness of the frame: distinguishes the time order exactly
        def __call__(self, images, prompts, metadata=None):
            return RewardOutput(images.mean(dim=(1, 2, 3)))

    ramp = torch.linspace(0.1, 0.4, 4).view(1, 4, 1, 1, 1).expand(1, 4, 3, 8, 8)
    out = PerFrame(FrameIndexReward())(ramp, ["x"])
    torch.testing.assert_close(out.info["per_frame"], torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    with pytest.raises(ValueError, match="3 channels"):
        PerFrame(FrameIndexReward())(ramp.transpose(1, 2), ["x"])


def test_video_scores_follow_their_prompts_when_the_batch_is_permuted():
    rows = load_prompts("video_train")[:6]
    videos = videos_to_tensor(np.stack([render_video(r, seed=i) for i, r in enumerate(rows)]))
    prompts = [r["prompt"] for r in rows]
    # pair each video with the *next* prompt so the scores differ between videos
    shifted, meta = prompts[1:] + prompts[:1], rows[1:] + rows[:1]
    for reward in [VideoMotion(), PerFrame("clip_score"), build_reward("per_frame", image_reward="geneval_shapes")]:
        base = reward(videos, shifted, meta).scores  # per-frame geneval_shapes reads the rows' include entries
        perm = torch.tensor([3, 0, 5, 1, 4, 2])
        permuted = reward(videos[perm], [shifted[i] for i in perm], [meta[i] for i in perm]).scores
        torch.testing.assert_close(permuted, base[perm])
        assert len(set(base.tolist())) > 1
    assert torch.equal(VideoMotion()(videos, prompts).scores, torch.ones(6))
    assert VideoMotion()(videos, shifted).scores.mean() < 1


def test_temporal_consistency_is_one_for_a_still_video_and_lower_for_a_changing_one():
    still = videos_to_tensor(render_video(parse_video_caption("a red circle staying still"), 0))[None]
    changing = hand_built_video()[None]
    for features in ["pixels", "tiny_clip"]:
        reward = TemporalConsistency(features=features)
        s, c = reward(still, ["x"]).scores, reward(changing, ["x"]).scores
        torch.testing.assert_close(s, torch.ones(1), rtol=0, atol=1e-5)
        assert c < s
    assert build_reward("temporal_consistency", features="pixels").layout == "BFCHW"


def test_video_prompt_splits_cover_every_motion():
    """Every motion in both splits and both tags. The held-out single-object captions were all "moving up" (every 5th
    of the (colour, shape, motion) product holds the same motion), and the train split had no single-object "moving
    up" left. Now type k holds out motion k + 2 (mod 5): 12 held-out captions, each motion 2 or 3 times."""
    from collections import Counter

    splits = all_video_prompts()
    for split in ("video_train", "video_heldout"):
        for tag in ("motion", "two_motion"):
            motions = Counter(e["motion"] for r in splits[split] if r["tag"] == tag for e in r["include"])
            assert set(motions) == {"left", "right", "up", "down", "still"}, (split, tag, motions)
    held = Counter(r["include"][0]["motion"] for r in splits["video_heldout"] if r["tag"] == "motion")
    assert sorted(held.values()) == [2, 2, 2, 3, 3]
    types = {(r["include"][0]["color"], r["include"][0]["class"]) for r in splits["video_heldout"] if r["tag"] == "motion"}
    assert len(types) == 12  # one held-out motion per (colour, shape); its other four motions are trained on
