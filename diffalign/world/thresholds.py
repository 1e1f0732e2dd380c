"""How far an image's objects sit from the verifier's thresholds, and which threshold a change crosses.

The verifier (`diffalign.world.verifier`) reads objects through a handful of thresholds: a component counts when it
has at least `MIN_AREA` (6) pixels; its shape is a square when its fill ratio (area / bounding-box area) is above
0.86, a triangle below 0.66 (or when its bottom row is at least 2.5 × its top row + 1), a circle between; its colour
is the nearest palette entry of each pixel; components are 4-connected per colour, so two objects of one colour
merge when they touch; a relation holds when the centroid difference along its axis exceeds `POSITION_MARGIN`
(1.5 px). `object_margins` measures, for every object the verifier segments, how far it is from each of them;
`explain_change` names the threshold that a change between two images of one prompt crossed (a one-pixel edge
change, `diffalign.world.edges`, or a weight change of the model). Used by ``experiments/margin_study.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from diffalign.world.edges import edge_variants
from diffalign.world.render import COLORS
from diffalign.world.verifier import (
    FOREGROUND_THRESHOLD,
    MIN_AREA,
    POSITION_MARGIN,
    Detection,
    classify_shape,
    detect,
    segment,
    to_uint8,
    verify,
)

SQUARE_FILL = 0.86  # classify_shape: fill > 0.86 is a square
TRIANGLE_FILL = 0.66  # classify_shape: fill < 0.66 is a triangle
_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_AXIS = {"left of": (-1, 0), "right of": (1, 0), "above": (0, -1), "below": (0, 1)}


@dataclass
class ObjectMargin:
    """One segmented object and its distances to the verifier's thresholds.

    Attributes:
        shape, color: as the verifier reads them.
        area: pixels (threshold `MIN_AREA`).
        half_size: ``(max(bbox height, bbox width) - 1) / 2`` px, the renderer's half-size `r` for a clean render
            (a render of half-size r spans 2r + 1 px).
        fill: area / bounding-box area.
        fill_margin: distance of `fill` into its shape's band: ``fill - 0.86`` for a square, ``0.66 - fill`` for a
            triangle, ``min(0.86 - fill, fill - 0.66)`` for a circle (negative for a triangle read from its rows).
        color_distance: Euclidean RGB distance (0–255 units) of the object's mean colour to its palette entry (the
            renderer's jitter is at most 15 per channel, 26 in all).
        color_margin: the mean over the object's pixels of (distance to the second-nearest palette entry − distance
            to the nearest), RGB units; small means the pixels are near another colour's boundary.
        gap: background pixels on the shortest 4-connected path to the nearest other object of the same colour
            (Manhattan distance − 1; ``inf`` when there is none): at 1 or less, one pixel of growth merges them.
    """

    shape: str
    color: str
    area: int
    half_size: float
    fill: float
    fill_margin: float
    color_distance: float
    color_margin: float
    gap: float


def _fill_margin(shape: str, fill: float) -> float:
    if shape == "square":
        return fill - SQUARE_FILL
    if shape == "triangle":
        return TRIANGLE_FILL - fill
    return min(SQUARE_FILL - fill, fill - TRIANGLE_FILL)


def object_margins(image: np.ndarray) -> list[ObjectMargin]:
    """Every object of `image` (uint8 `(H, W, 3)`, or float in [0, 1]) as `segment` finds it, in segment order, with
    its distances to the verifier's thresholds (`ObjectMargin`)."""
    img = to_uint8(image)
    pix = img.astype(np.float32)
    dist = np.sqrt(((pix[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1))  # (H, W, colours)
    two = np.sort(dist, axis=-1)[..., :2]
    objects = segment(img)
    coords = [np.argwhere(mask) for _, mask in objects]
    out = []
    for k, (cname, mask) in enumerate(objects):
        sl = ndimage.find_objects(mask.astype(np.int32))[0]
        crop = mask[sl]
        shape, fill = classify_shape(crop)
        palette = _PALETTE[list(COLORS).index(cname)]
        same = [coords[j] for j, (c, _) in enumerate(objects) if j != k and c == cname]
        gap = min((float(np.abs(coords[k][:, None] - c[None]).sum(-1).min()) - 1 for c in same), default=float("inf"))
        out.append(ObjectMargin(shape, cname, int(mask.sum()), (max(crop.shape) - 1) / 2, fill,
                                _fill_margin(shape, fill), float(np.linalg.norm(pix[mask].mean(0) - palette)),
                                float((two[mask, 1] - two[mask, 0]).mean()), gap))
    return out


def stray_pixels(image: np.ndarray) -> int:
    """The largest foreground component (per colour, 4-connected) that the verifier drops for being under
    `MIN_AREA` pixels, in pixels (0 when none): at ``MIN_AREA - 1`` one more pixel makes it an extra object."""
    img = to_uint8(image).astype(np.float32)
    fg = img.max(axis=-1) > FOREGROUND_THRESHOLD
    nearest = ((img[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1).argmin(-1)
    best = 0
    for ci in range(len(_PALETTE)):
        labels, n = ndimage.label(fg & (nearest == ci))
        sizes = np.bincount(labels.ravel())[1:] if n else np.zeros(0, int)
        small = sizes[sizes < MIN_AREA]
        best = max(best, int(small.max()) if len(small) else 0)
    return best


def relation_margins(image: np.ndarray, spec: dict) -> list[float]:
    """For each position constraint of `spec` whose subject and anchor are each detected exactly once: the centroid
    difference along the relation's axis minus `POSITION_MARGIN` (px; > 0 where the relation holds)."""
    dets = detect(image)
    out = []
    for i, entry in enumerate(spec["include"]):
        if not entry.get("position"):
            continue
        rel, j = entry["position"]

        def pick(e: dict) -> list[Detection]:
            return [d for d in dets if d.shape == e["class"] and (not e.get("color") or d.color == e["color"])]

        subj, anch = pick(entry), pick(spec["include"][j])
        if len(subj) == 1 and len(anch) == 1:
            ax, ay = _AXIS[rel]
            out.append(ax * (subj[0].cx - anch[0].cx) + ay * (subj[0].cy - anch[0].cy) - POSITION_MARGIN)
    return out


def _crossing(f0: float, f1: float) -> str:
    lo, hi = min(f0, f1), max(f0, f1)
    if lo < SQUARE_FILL <= hi:
        return "fill 0.86"
    if lo < TRIANGLE_FILL <= hi:
        return "fill 0.66"
    return "triangle row rule"


def explain_change(before: np.ndarray, after: np.ndarray, spec: dict) -> str:
    """Which verifier threshold the change from `before` (judged correct for `spec`) to `after` crossed, in words:

    - ``"object lost: area < 6"``: an object fell under `MIN_AREA` (or out of the foreground);
    - ``"merge"``: two objects of one colour became one component;
    - ``"split"``: one object became two components of at least `MIN_AREA`;
    - ``"extra object"``: a new component of at least `MIN_AREA` appeared elsewhere;
    - ``"shape <a>→<b> at fill 0.86"`` / ``"... at fill 0.66"`` / ``"... by the triangle row rule"``: an object kept
      its place and colour and changed shape; the threshold its fill ratio crossed;
    - ``"colour <a>→<b>"``: an object kept its place and changed its palette colour;
    - ``"relation margin 1.5 px"``: the same objects, a relation no longer holds;
    - ``"still correct"`` when `after` is correct.

    Colour by colour, a change in the number of objects is a merge when the components left keep at least 80 % of
    the pixels (else an object lost), a split when the components total at most 120 % of them (else an extra
    object); with the counts unchanged, objects are matched by the nearest centroid of the same colour within 3 px
    (else of any colour: a colour change).
    """
    if verify(after, spec).correct:
        return "still correct"
    d0, d1 = detect(before), detect(after)
    if len(d0) == len(d1):
        for d in d0:
            match = min((e for e in d1 if e.color == d.color), key=lambda e: _dist(d, e), default=None)
            if match is None or _dist(d, match) > 3:
                other = min(d1, key=lambda e: _dist(d, e), default=None)
                if other is not None and other.color != d.color and _dist(d, other) <= 3:
                    return f"colour {d.color}→{other.color}"
                continue
            if match.shape != d.shape:
                how = _crossing(d.fill, match.fill)
                return f"shape {d.shape}→{match.shape} " + ("by the triangle row rule" if how == "triangle row rule"
                                                           else f"at {how}")
    for color in COLORS:  # a colour whose object count changed: lost / merged, split / extra
        a0 = [d.area for d in d0 if d.color == color]
        a1 = [d.area for d in d1 if d.color == color]
        if len(a1) < len(a0):
            return "merge" if a1 and sum(a1) >= 0.8 * sum(a0) else "object lost: area < 6"
        if len(a1) > len(a0):
            return "split" if a0 and sum(a1) <= 1.2 * sum(a0) else "extra object"
    return "relation margin 1.5 px"


def _dist(a: Detection, b: Detection) -> float:
    return float(np.hypot(a.cx - b.cx, a.cy - b.cy))


def edge_flip_causes(image: np.ndarray, spec: dict) -> list[tuple[int, str, str]]:
    """For a correct `image`: ``(object index, change, explain_change(...))`` for every one-pixel edge variant
    (`diffalign.world.edges.edge_variants`) that the verifier judges wrong; empty when none flips or the image is not
    correct."""
    img = to_uint8(image)
    if not verify(img, spec).correct:
        return []
    return [(k, change, explain_change(img, variant, spec)) for k, change, variant in edge_variants(img)
            if not verify(variant, spec).correct]
