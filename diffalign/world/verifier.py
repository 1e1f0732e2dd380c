"""The shapes world's verifier: detects objects in an image and checks a prompt's GenEval-style constraints.

Detection: a pixel is foreground when its largest channel exceeds `FOREGROUND_THRESHOLD`; each foreground pixel takes
its nearest palette colour; connected components (4-connectivity, `scipy.ndimage.label`) are found per colour and
those under `MIN_AREA` pixels are ignored. The shape comes from the component's fill ratio (area / bounding-box area)
and the widths of its top and bottom rows.

Constraints, for include entry ``i`` (see `constraints`): ``count/i`` — the number of detected objects of the class is
the entry's count; ``color/i`` — that many of them have the entry's colour (only when a colour is given);
``position/i`` — the entry's single object is on the named side of the anchor entry's object, centroid difference
above `POSITION_MARGIN` px; and one global ``no_extra`` — no detected object beyond those the prompt asks for. The
dense score is the fraction of constraints met, the binary ``correct`` is all of them met (GenEval's strictness).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from diffalign.world.render import COLORS, COUNT_WORDS, RELATIONS, SHAPES

FOREGROUND_THRESHOLD = 90
MIN_AREA = 6
POSITION_MARGIN = 1.5
_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_COLOR_NAMES = list(COLORS)


@dataclass
class Detection:
    """A detected object: `shape`, `color`, centroid `(cx, cy)` in px, `area` in px, `fill` ratio."""

    shape: str
    color: str
    cx: float
    cy: float
    area: int
    fill: float


@dataclass
class Verdict:
    """The verifier's answer for one image: `score` in [0, 1], `correct`, the per-constraint results and the
    detections (for debugging)."""

    score: float
    correct: bool
    constraints: dict[str, bool]
    detections: list[Detection] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [k for k, ok in self.constraints.items() if not ok]


def classify_shape(mask: np.ndarray) -> tuple[str, float]:
    """Shape of one component from its boolean mask `(h, w)` cropped to its bounding box; returns `(shape, fill)`."""
    h, w = mask.shape
    fill = float(mask.sum()) / float(h * w)
    top, bottom = int(mask[0].sum()), int(mask[-1].sum())
    if fill > 0.86:
        return "square", fill
    if fill < 0.66 or bottom >= 2.5 * top + 1 and h >= 4:
        return "triangle", fill
    return "circle", fill


def to_uint8(image: np.ndarray) -> np.ndarray:
    """A uint8 `(H, W, 3)` image as the verifier reads it: uint8 input unchanged, float in [0, 1] rounded
    (``clip(x, 0, 1) * 255 + 0.5``, truncated).

    Raises:
        ValueError: when the image is not channels-last `(H, W, 3)`.
    """
    img = np.asarray(image)
    if img.dtype != np.uint8:
        img = (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if img.ndim != 3 or img.shape[-1] != 3:
        raise ValueError(f"image must be (H, W, 3), got shape {img.shape}; pass channels-last RGB")
    return img


def segment(image: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The objects' pixels as the verifier sees them: for a uint8 `(H, W, 3)` image (or float in [0, 1]), one
    ``(colour name, boolean mask (H, W))`` per connected component of at least `MIN_AREA` pixels, colour by colour in
    palette order, components in `scipy.ndimage.label` order."""
    pix = to_uint8(image).astype(np.float32)
    fg = pix.max(axis=-1) > FOREGROUND_THRESHOLD
    nearest = ((pix[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1).argmin(-1)
    found: list[tuple[str, np.ndarray]] = []
    for ci, cname in enumerate(_COLOR_NAMES):
        labels, n = ndimage.label(fg & (nearest == ci))
        for k in range(1, n + 1):
            mask = labels == k
            if int(mask.sum()) >= MIN_AREA:
                found.append((cname, mask))
    return found


def detect(image: np.ndarray) -> list[Detection]:
    """Objects in a uint8 `(H, W, 3)` image (or float in [0, 1]), sorted by (cy, cx)."""
    found: list[Detection] = []
    for cname, mask in segment(image):
        sl = ndimage.find_objects(mask.astype(np.int32))[0]
        comp = mask[sl]
        shape, fill = classify_shape(comp)
        ys, xs = np.nonzero(comp)  # centroid in the crop's coordinates plus its offset, as always computed
        found.append(Detection(shape, cname, float(xs.mean() + sl[1].start), float(ys.mean() + sl[0].start),
                               int(comp.sum()), fill))
    return sorted(found, key=lambda d: (d.cy, d.cx))


def _side_ok(subject: Detection, anchor: Detection, relation: str) -> bool:
    dx, dy = subject.cx - anchor.cx, subject.cy - anchor.cy
    return {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation] > POSITION_MARGIN


def constraints(spec: dict, detections: list[Detection]) -> dict[str, bool]:
    """Checks every constraint of `spec` (GenEval metadata) against `detections`; see the module docstring."""
    result: dict[str, bool] = {}
    include = spec["include"]
    for i, entry in enumerate(include):
        # entries may share a class ("a red circle and a blue circle"): counts add up per class and per colour
        of_class = [d for d in detections if d.shape == entry["class"]]
        result[f"count/{i}"] = len(of_class) == sum(e["count"] for e in include if e["class"] == entry["class"])
        if entry.get("color"):
            same = sum(e["count"] for e in include if e["class"] == entry["class"] and e.get("color") == entry["color"])
            result[f"color/{i}"] = sum(d.color == entry["color"] for d in of_class) == same
    for i, entry in enumerate(include):
        if not entry.get("position"):
            continue
        rel, j = entry["position"]

        def pick(e: dict) -> list[Detection]:
            return [d for d in detections if d.shape == e["class"] and (not e.get("color") or d.color == e["color"])]

        subj, anch = pick(entry), pick(include[j])
        result[f"position/{i}"] = len(subj) == 1 and len(anch) == 1 and _side_ok(subj[0], anch[0], rel)
    expected = sum(e["count"] for e in include)
    result["no_extra"] = len(detections) <= expected
    return result


def verify(image: np.ndarray, spec: dict) -> Verdict:
    """Detects the objects of one image and checks `spec`; returns a `Verdict`."""
    dets = detect(image)
    cons = constraints(spec, dets)
    return Verdict(score=sum(cons.values()) / len(cons), correct=all(cons.values()), constraints=cons, detections=dets)


_WORD_COUNT = {"a": 1, **{w: n for n, w in COUNT_WORDS.items()}}
_SHAPE_WORD = {**{s: s for s in SHAPES}, **{s + "s": s for s in SHAPES}}
_PHRASE = r"(a|two|three) (?:(red|green|blue|yellow) )?(circles?|squares?|triangles?)"


def parse_caption(text: str) -> dict:
    """Rebuilds a prompt's GenEval-style metadata from its caption alone.

    Raises:
        ValueError: when the caption is not one of the world's templates.
    """
    text = " ".join(text.strip().lower().split())

    def entry(m: tuple[str, str, str]) -> dict:
        e = {"class": _SHAPE_WORD[m[2]], "count": _WORD_COUNT[m[0]]}
        if m[1]:
            e["color"] = m[1]
        return e

    rel_alt = "|".join(RELATIONS)
    m = re.fullmatch(rf"{_PHRASE} ({rel_alt}) {_PHRASE}", text)
    if m:
        g = m.groups()
        subj, anch = entry(g[0:3]), entry(g[4:7])
        subj["position"] = [g[3], 0]
        return {"tag": "position", "include": [anch, subj], "prompt": text}
    m = re.fullmatch(rf"{_PHRASE} and {_PHRASE}", text)
    if m:
        g = m.groups()
        inc = [entry(g[0:3]), entry(g[3:6])]
        tag = "color_attr" if any("color" in e for e in inc) else "two_object"
        return {"tag": tag, "include": inc, "prompt": text}
    m = re.fullmatch(_PHRASE, text)
    if m:
        e = entry(m.groups())
        tag = "counting" if e["count"] > 1 else ("colors" if "color" in e else "single_object")
        return {"tag": tag, "include": [e], "prompt": text}
    raise ValueError(f"caption {text!r} is not a shapes-world prompt; see diffalign.world.prompts for the templates")
