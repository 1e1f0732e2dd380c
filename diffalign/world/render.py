"""Renderer of the shapes world: coloured circles, squares and triangles on a black background.

A *spec* is a prompt's GenEval-style metadata (``{"tag": ..., "include": [{"class", "count", "color"?,
"position"?}, ...]}``); a *scene* is a concrete list of objects that satisfies it. Everything is deterministic from a
seed: ``render(scene_from_spec(spec, seed))`` gives identical pixels for the same spec and seed.

Images are `uint8` arrays `(H, W, 3)` (``to_tensor`` gives float32 `(3, H, W)` in [0, 1]).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 32
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 235), "yellow": (230, 215, 40)}
COUNT_WORDS = {2: "two", 3: "three"}
RELATIONS = ("left of", "right of", "above", "below")
COLOR_JITTER = 15
MIN_GAP = 2  # px between object bounding boxes
MIN_REL_SEPARATION = 6  # px along the relation's axis for position scenes


@dataclass(frozen=True)
class SceneMargins:
    """How far a scene's objects sit from the verifier's thresholds: the half-size ranges in pixels (inclusive) by
    number of objects (`radius_1`, `radius_2`, `radius_3`, the last for three or more), the smallest gap between two
    objects' bounding boxes (`min_gap`, px), the smallest separation along a relation's axis (`min_rel_separation`,
    px; the verifier needs more than 1.5), and `antialias`, the supersampling factor of `render` (1: hard edges).

    `DEFAULT_MARGINS` is the world as it always was (the shipped models' training data, every ground-truth render of
    the tests); `WIDE_MARGINS` is the training data of the stronger base (scripts/pretrain_tiny_world.py flow2):
    no object at half-size 3, where one pixel of erosion turns a triangle into a "circle" for the verifier's fill
    test, wider gaps so that blurred objects do not merge, relations at 8 px or more.
    """

    radius_1: tuple[int, int] = (4, 7)
    radius_2: tuple[int, int] = (3, 6)
    radius_3: tuple[int, int] = (3, 5)
    min_gap: float = MIN_GAP
    min_rel_separation: float = MIN_REL_SEPARATION
    antialias: int = 1

    def radius_range(self, n_objects: int) -> tuple[int, int]:
        return {1: self.radius_1, 2: self.radius_2}.get(n_objects, self.radius_3)


DEFAULT_MARGINS = SceneMargins()
WIDE_MARGINS = SceneMargins(radius_1=(5, 7), radius_2=(4, 6), radius_3=(4, 5), min_gap=3, min_rel_separation=8)


def plural(shape: str) -> str:
    return shape + "s"


@dataclass
class SceneObject:
    """One object: `shape` in SHAPES, `color` in COLORS, centre `(cx, cy)` and half-size `r` in pixels, `rgb` the
    jittered fill colour."""

    shape: str
    color: str
    cx: float
    cy: float
    r: float
    rgb: tuple[int, int, int]

    def bbox(self) -> tuple[float, float, float, float]:
        return self.cx - self.r, self.cy - self.r, self.cx + self.r, self.cy + self.r


def caption(spec: dict) -> str:
    """The caption of a spec, from fixed templates, e.g. ``"two blue squares"``, ``"a red circle left of a green
    triangle"``. Inverse of `diffalign.world.verifier.parse_caption`."""
    inc = spec["include"]

    def phrase(entry: dict) -> str:
        color = f"{entry['color']} " if entry.get("color") else ""
        if entry["count"] == 1:
            return f"a {color}{entry['class']}"
        return f"{COUNT_WORDS[entry['count']]} {color}{plural(entry['class'])}"

    if spec["tag"] == "position":
        rel, _ = inc[1]["position"]
        return f"{phrase(inc[1])} {rel} {phrase(inc[0])}"
    return " and ".join(phrase(e) for e in inc)


def _overlaps(a: SceneObject, b: SceneObject, gap: float = MIN_GAP) -> bool:
    ax0, ay0, ax1, ay1 = a.bbox()
    bx0, by0, bx1, by1 = b.bbox()
    return not (ax1 + gap < bx0 or bx1 + gap < ax0 or ay1 + gap < by0 or by1 + gap < ay0)


def relation_holds(subject: SceneObject, anchor: SceneObject, relation: str, margin: float) -> bool:
    """True when `subject` is `relation` of `anchor` by more than `margin` px along the relation's axis, and that axis
    dominates the displacement."""
    dx, dy = subject.cx - anchor.cx, subject.cy - anchor.cy
    along, across = {"left of": (-dx, dy), "right of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[relation]
    return along > margin and along > abs(across)


def scene_from_spec(spec: dict, seed: int, size: int = IMAGE_SIZE,
                    margins: SceneMargins = DEFAULT_MARGINS) -> list[SceneObject]:
    """A random scene satisfying `spec` (colours left open are drawn at random), deterministic in `seed`, with the
    object sizes, gaps and relation separations of `margins`.

    Raises:
        ValueError: if the spec names an unknown shape, colour or relation.
    """
    rng = np.random.default_rng(seed)
    wanted: list[tuple[str, str, int]] = []  # (shape, color, include index)
    for i, entry in enumerate(spec["include"]):
        if entry["class"] not in SHAPES:
            raise ValueError(f"spec class {entry['class']!r} is not one of {SHAPES}")
        if entry.get("color") is not None and entry["color"] not in COLORS:
            raise ValueError(f"spec color {entry['color']!r} is not one of {tuple(COLORS)}")
        for _ in range(entry["count"]):
            color = entry.get("color") or list(COLORS)[rng.integers(len(COLORS))]
            wanted.append((entry["class"], color, i))
    lo, hi = margins.radius_range(len(wanted))
    position = [(i, e["position"]) for i, e in enumerate(spec["include"]) if e.get("position")]
    for _attempt in range(1000):
        objects: list[SceneObject] = []
        for shape, color, _ in wanted:
            r = float(rng.integers(lo, hi + 1))
            for _try in range(200):
                cx = float(rng.uniform(r, size - 1 - r))
                cy = float(rng.uniform(r, size - 1 - r))
                rgb = tuple(int(np.clip(c + rng.integers(-COLOR_JITTER, COLOR_JITTER + 1), 0, 255)) for c in COLORS[color])
                obj = SceneObject(shape, color, round(cx), round(cy), r, rgb)
                if not any(_overlaps(obj, o, margins.min_gap) for o in objects):
                    objects.append(obj)
                    break
            else:
                break
        if len(objects) < len(wanted):
            continue
        ok = True
        for i, (rel, j) in position:
            if rel not in RELATIONS:
                raise ValueError(f"spec position relation {rel!r} is not one of {RELATIONS}")
            subj = next(o for o, w in zip(objects, wanted) if w[2] == i)
            anch = next(o for o, w in zip(objects, wanted) if w[2] == j)
            ok &= relation_holds(subj, anch, rel, margins.min_rel_separation)
        if ok:
            return objects
    raise RuntimeError(f"could not place a scene for {spec} in 1000 attempts")  # pragma: no cover


def render(objects: list[SceneObject], size: int = IMAGE_SIZE, antialias: int = 1) -> np.ndarray:
    """Draws `objects` on a black `size`×`size` canvas; returns uint8 `(size, size, 3)`.

    With ``antialias = k > 1`` the scene is drawn at ``k * size`` and box-filtered down: edge pixels take the fraction
    of the pixel each object covers (blended with black), as a camera would. The object covers the same pixel extent
    as at ``antialias=1``, where PIL fills the pixels from the first to the last coordinate inclusive: an extent
    ``[a, b]`` in pixel centres becomes the area ``[a - 0.5, b + 0.5]``, drawn at scale k as ``[a k, (b + 1) k - 1]``.
    ``antialias=1`` draws hard edges (PIL's rasterisation).

    Raises:
        ValueError: when `antialias` < 1.
    """
    if antialias < 1:
        raise ValueError(f"antialias must be an integer >= 1 (supersampling factor), got {antialias}")
    k = int(antialias)
    img = Image.new("RGB", (size * k, size * k), (0, 0, 0))
    draw = ImageDraw.Draw(img)

    def lo(v: float) -> float:  # the first covered coordinate at scale k (k = 1 keeps v exactly: PIL truncates)
        return v if k == 1 else v * k

    def hi(v: float) -> float:  # the last covered coordinate at scale k
        return v if k == 1 else (v + 1) * k - 1

    def mid(v: float) -> float:  # a pixel centre at scale k
        return v if k == 1 else (v + 0.5) * k - 0.5

    for o in objects:
        x0, y0, x1, y1 = o.bbox()
        if o.shape == "circle":
            draw.ellipse((lo(x0), lo(y0), hi(x1), hi(y1)), fill=o.rgb)
        elif o.shape == "square":
            s = 0.85 * o.r
            draw.rectangle((lo(o.cx - s), lo(o.cy - s), hi(o.cx + s), hi(o.cy + s)), fill=o.rgb)
        else:
            draw.polygon([(mid(o.cx), lo(y0)), (hi(x1), hi(y1)), (lo(x0), hi(y1))], fill=o.rgb)
    if k > 1:
        img = img.resize((size, size), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.uint8).copy()


def render_spec(spec: dict, seed: int, size: int = IMAGE_SIZE, margins: SceneMargins = DEFAULT_MARGINS) -> np.ndarray:
    """`render(scene_from_spec(spec, seed, size, margins), size, margins.antialias)`: a ground-truth image for the
    spec, uint8 `(size, size, 3)`."""
    return render(scene_from_spec(spec, seed, size, margins), size, margins.antialias)


def to_tensor(images: np.ndarray):
    """uint8 `(H, W, 3)` or `(B, H, W, 3)` → float32 torch tensor `(3, H, W)` / `(B, 3, H, W)` in [0, 1]."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    return t.permute(2, 0, 1) if t.ndim == 3 else t.permute(0, 3, 1, 2)


def corrupt_spec(spec: dict, seed: int) -> tuple[dict, str]:
    """A spec that the original caption does *not* describe, for losing images and negative tests.

    Returns `(spec, kind)` with `kind` in ``{"color", "count", "shape", "swap"}``: a changed colour, a count off by one,
    a changed shape, or (for position specs) the subject and anchor swapped.
    """
    rng = np.random.default_rng(seed)
    bad = copy.deepcopy(spec)
    kinds = ["count", "shape"] + (["color"] if any(e.get("color") for e in bad["include"]) else [])
    if spec["tag"] == "position":
        kinds = ["swap", "swap", "shape"] + (["color"] if "color" in kinds else [])
    kind = kinds[rng.integers(len(kinds))]
    i = int(rng.integers(len(bad["include"])))
    entry = bad["include"][i]
    if kind == "swap":
        rel, _ = bad["include"][1]["position"]
        bad["include"][1]["position"] = [{"left of": "right of", "right of": "left of", "above": "below",
                                          "below": "above"}[rel], 0]
    elif kind == "color":
        entry = next(e for e in bad["include"] if e.get("color"))
        entry["color"] = [c for c in COLORS if c != entry["color"]][rng.integers(len(COLORS) - 1)]
    elif kind == "shape":
        entry["class"] = [s for s in SHAPES if s != entry["class"]][rng.integers(len(SHAPES) - 1)]
    else:
        entry["count"] = entry["count"] + 1 if entry["count"] < 3 and (entry["count"] == 1 or rng.random() < 0.5) \
            else entry["count"] - 1
    return bad, kind
