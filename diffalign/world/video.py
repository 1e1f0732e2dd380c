"""The shapes world's video variant: objects that move left / right / up / down or stay still, captions, prompts,
and a verifier that tracks each object across frames.

A *video spec* is GenEval-style metadata with a motion per object, e.g. ``{"tag": "motion", "include": [{"class":
"circle", "count": 1, "color": "red", "motion": "left"}]}``; captions come from fixed templates — "a red circle moving
left", "a blue square staying still", "a red circle moving up and a green triangle moving right" (tag
``two_motion``). Videos are uint8 `(F, H, W, 3)` arrays, F = 8 frames of 32×32 by default, deterministic in the seed;
an object moves `SPEED` px per frame in a straight line (10.5 px over 8 frames) and never leaves the frame or touches
another object in any frame.

Verifier (`verify_video`): each frame goes through the image verifier's detector (`diffalign.world.verifier.detect`);
for include entry ``i``:

- ``identity/i`` — the object is kept across frames: in every frame exactly one object of the entry's colour is
  detected and it has the entry's shape (it never vanishes, splits, or turns into another shape);
- ``motion/i`` — its track moves the right way: for "still" the centroid stays within `STILL_TOLERANCE` px of its
  first-frame position; otherwise the net first→last displacement along the named axis is at least `MIN_TRAVEL` px in
  the named direction and dominates the other axis, and no frame-to-frame step goes backwards by more than
  `BACKTRACK_TOLERANCE` px;
- ``no_extra`` — no frame holds more objects than the prompt names.

The dense score is the fraction of constraints met, ``correct`` all of them (GenEval strictness). Accuracy on
ground-truth renders is 100 % (tests/unit/world/test_video_world.py).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np

from diffalign.world.render import COLORS, MIN_GAP, SHAPES, SceneObject, render
from diffalign.world.verifier import Detection, detect

MOTIONS = ("left", "right", "up", "down", "still")
VELOCITY = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1), "still": (0, 0)}
NUM_FRAMES = 8
VIDEO_SIZE = 32
SPEED = 1.5  # px per frame
STILL_TOLERANCE = 2.0
MIN_TRAVEL = 4.0
BACKTRACK_TOLERANCE = 1.5


def motion_phrase(motion: str) -> str:
    return "staying still" if motion == "still" else f"moving {motion}"


def video_caption(spec: dict) -> str:
    """The caption of a video spec, e.g. ``"a red circle moving left and a blue square staying still"``."""
    return " and ".join(f"a {e['color']} {e['class']} {motion_phrase(e['motion'])}" for e in spec["include"])


_VPHRASE = r"a (red|green|blue|yellow) (circle|square|triangle) (moving (?:left|right|up|down)|staying still)"


def parse_video_caption(text: str) -> dict:
    """Inverse of `video_caption`.

    Raises:
        ValueError: for text that is not a video caption of the shapes world.
    """
    parts = text.strip().split(" and ")
    include = []
    for part in parts:
        m = re.fullmatch(_VPHRASE, part.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a shapes-world video caption (e.g. 'a red circle moving left')")
        motion = "still" if m.group(3) == "staying still" else m.group(3).split()[1]
        include.append({"class": m.group(2), "count": 1, "color": m.group(1), "motion": motion})
    if len(include) > 2:
        raise ValueError(f"{text!r}: at most two objects per video caption")
    return {"tag": "motion" if len(include) == 1 else "two_motion", "include": include}


def video_scene(spec: dict, seed: int, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE
                ) -> list[tuple[SceneObject, str]]:
    """Objects at frame 0 with their motions, satisfying `spec`; deterministic in `seed`.

    Raises:
        RuntimeError: when no layout is found (does not happen for the shipped specs).
    """
    rng = np.random.default_rng(seed)
    n = len(spec["include"])
    lo, hi = (4, 6) if n == 1 else (3, 5)
    d = SPEED * (num_frames - 1)
    for _ in range(1000):
        placed: list[tuple[SceneObject, str]] = []
        ok = True
        for e in spec["include"]:
            r = float(rng.integers(lo, hi + 1))
            vx, vy = VELOCITY[e["motion"]]
            xmin, xmax = r + 1 - min(0, vx) * d, size - r - 2 - max(0, vx) * d
            ymin, ymax = r + 1 - min(0, vy) * d, size - r - 2 - max(0, vy) * d
            if xmax <= xmin or ymax <= ymin:
                ok = False
                break
            jitter = rng.integers(-15, 16, size=3)
            rgb = tuple(int(np.clip(c + j, 0, 255)) for c, j in zip(COLORS[e["color"]], jitter))
            o = SceneObject(e["class"], e["color"], float(rng.uniform(xmin, xmax)), float(rng.uniform(ymin, ymax)),
                            r, rgb)
            for p, pm in placed:  # no contact in any frame
                for f in range(num_frames):
                    a, b = _at(o, e["motion"], f), _at(p, pm, f)
                    ax0, ay0, ax1, ay1 = a.bbox()
                    bx0, by0, bx1, by1 = b.bbox()
                    if not (ax1 + MIN_GAP < bx0 or bx1 + MIN_GAP < ax0 or ay1 + MIN_GAP < by0 or by1 + MIN_GAP < ay0):
                        ok = False
            if not ok:
                break
            placed.append((o, e["motion"]))
        if ok:
            return placed
    raise RuntimeError(f"no layout for {spec} in 1000 tries")


def _at(o: SceneObject, motion: str, frame: int) -> SceneObject:
    vx, vy = VELOCITY[motion]
    return SceneObject(o.shape, o.color, o.cx + vx * SPEED * frame, o.cy + vy * SPEED * frame, o.r, o.rgb)


def render_video(spec: dict, seed: int, num_frames: int = NUM_FRAMES, size: int = VIDEO_SIZE) -> np.ndarray:
    """A ground-truth video of `spec`: uint8 `(num_frames, size, size, 3)`."""
    scene = video_scene(spec, seed, num_frames, size)
    return np.stack([render([_at(o, m, f) for o, m in scene], size) for f in range(num_frames)])


def videos_to_tensor(videos: np.ndarray):
    """uint8 `(F, H, W, 3)` or `(B, F, H, W, 3)` → float32 `(F, 3, H, W)` / `(B, F, 3, H, W)` in [0, 1]."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(videos)).float().div_(255.0)
    return t.movedim(-1, -3)


@dataclass
class VideoVerdict:
    """`score` (fraction of constraints met), `correct` (all met), `constraints` (name → bool), `tracks` (per
    include entry, the per-frame centroids or None where the object was not found), `detections` (per frame)."""

    score: float
    correct: bool
    constraints: dict[str, bool]
    tracks: list[list[tuple[float, float] | None]] = field(default_factory=list)
    detections: list[list[Detection]] = field(default_factory=list)


def _named_axis(motion: str) -> tuple[int, int]:
    """The axis (0 = x, 1 = y) a moving `motion` runs along, and its sign there (image y grows downwards)."""
    vx, vy = VELOCITY[motion]
    return (0, vx) if vx else (1, vy)


def _net_displacement(track, motion: str) -> tuple[float, float]:
    """A complete track's first→last displacement for a moving `motion`: (along the named way, |across it|) in px."""
    axis, sign = _named_axis(motion)
    return sign * (track[-1][axis] - track[0][axis]), abs(track[-1][1 - axis] - track[0][1 - axis])


def _motion_ok(track: list[tuple[float, float]], motion: str) -> bool:
    xy = np.asarray(track, dtype=np.float64)
    if motion == "still":
        return bool(np.abs(xy - xy[0]).max() <= STILL_TOLERANCE)
    along, across = _net_displacement(xy, motion)
    axis, sign = _named_axis(motion)
    steps = sign * np.diff(xy[:, axis])
    return bool(along >= MIN_TRAVEL and along > across and (steps >= -BACKTRACK_TOLERANCE).all())


def direction_sign(tracks: list[list[tuple[float, float] | None]], spec: dict) -> list[bool]:
    """A softer motion measure than ``motion/i``: per moving include entry of `spec` whose track is complete (found in
    every frame), does its first→last displacement point the named way (positive along the named axis) and dominate
    the other axis? Still entries and incomplete tracks are skipped, so the list may be shorter than the entries. A
    direction drawn at random from the four gives about 0.25 on average.

    `tracks` are `VideoVerdict.tracks` (per entry, per frame, the centroid ``(x, y)`` in px or None)."""
    out = []
    for track, e in zip(tracks, spec["include"]):
        if e["motion"] == "still" or any(p is None for p in track):
            continue
        along, across = _net_displacement(track, e["motion"])
        out.append(bool(along > 0 and along > across))
    return out


def video_constraints(spec: dict, detections: list[list[Detection]]) -> tuple[dict[str, bool], list]:
    """Constraints of `spec` against per-frame `detections` (see the module docstring), and the tracks."""
    result: dict[str, bool] = {}
    tracks = []
    for i, e in enumerate(spec["include"]):
        per_frame = [[d for d in dets if d.color == e["color"]] for dets in detections]
        result[f"identity/{i}"] = all(len(c) == 1 and c[0].shape == e["class"] for c in per_frame)
        track, prev = [], None
        for cands in per_frame:  # nearest candidate of the entry's colour (and shape when possible) to the last one
            same = [d for d in cands if d.shape == e["class"]] or cands
            if not same:
                track.append(None)
                continue
            d = same[0] if prev is None else min(same, key=lambda d: (d.cx - prev[0]) ** 2 + (d.cy - prev[1]) ** 2)
            prev = (d.cx, d.cy)
            track.append(prev)
        tracks.append(track)
        result[f"motion/{i}"] = all(p is not None for p in track) and _motion_ok(track, e["motion"])
    expected = sum(e["count"] for e in spec["include"])
    result["no_extra"] = all(len(d) <= expected for d in detections)
    return result, tracks


def verify_video(video: np.ndarray, spec: dict) -> VideoVerdict:
    """Detects the objects of every frame of a uint8 `(F, H, W, 3)` (or float [0, 1]) video and checks `spec`."""
    dets = [detect(frame) for frame in np.asarray(video)]
    cons, tracks = video_constraints(spec, dets)
    return VideoVerdict(sum(cons.values()) / len(cons), all(cons.values()), cons, tracks, dets)


def all_video_prompts() -> dict[str, list[dict]]:
    """Every video prompt, by split ``{"video_train": [...], "video_heldout": [...]}``: every (colour, shape, motion)
    single-object caption (60; 12 held out: one motion per (colour, shape), cycling through the five motions, so
    both splits hold every motion) and the two-object captions of 40 object pairs with 2 motion combinations each
    (every 5th pair held out; the combinations vary with the pair; deterministic)."""
    types = [(c, s) for c in COLORS for s in SHAPES]
    train, held = [], []

    def row(tag, include):
        spec = {"tag": tag, "include": include}
        return {"prompt": video_caption(spec), **spec}

    for i, ((c, s), m) in enumerate(itertools.product(types, MOTIONS)):
        # type k holds out motion (k + 2) mod 5, so the held-out captions cover every motion (an earlier `i % 5 == 2`
        # held out "moving up" for every type: no single-object "moving up" caption was left to train on)
        k, j = divmod(i, len(MOTIONS))
        (held if j == (k + 2) % len(MOTIONS) else train).append(
            row("motion", [{"class": s, "color": c, "count": 1, "motion": m}]))
    rng = np.random.default_rng(7)
    pairs = [p for p in itertools.combinations(types, 2) if p[0][0] != p[1][0]]
    chosen = [pairs[k] for k in sorted(rng.choice(len(pairs), size=40, replace=False))]
    for i, (a, b) in enumerate(chosen):
        for j in range(2):
            shift = i // 5  # varies the held-out pairs' motions (without it every held-out pair had the same two)
            ma, mb = MOTIONS[(i + 2 * j + shift) % 5], MOTIONS[(3 * i + j + 1 + shift) % 5]
            (held if i % 5 == 3 else train).append(row("two_motion", [
                {"class": a[1], "color": a[0], "count": 1, "motion": ma},
                {"class": b[1], "color": b[0], "count": 1, "motion": mb}]))
    return {"video_train": train, "video_heldout": held}
