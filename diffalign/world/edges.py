"""One-pixel edge changes of the verifier's objects: how many correct images sit on a threshold of the verifier.

The fragility gate (`diffalign.evaluation.fragility`) asks, for every image the verifier judges correct, whether a
change of one pixel at an object's edge — one an eye would not see — already makes it wrong. The changes are made to
the objects the verifier itself segments (`diffalign.world.verifier.segment`), one object and one change at a time:

- ``grow``: every background pixel (largest channel ≤ `FOREGROUND_THRESHOLD`) 4-adjacent to the object takes the
  object's mean colour (a dilation by the 3×3 cross);
- ``shrink``: every object pixel with a 4-neighbour outside the object turns black (an erosion by the 3×3 cross);
- ``left``, ``right``, ``up``, ``down``: the object's pixels move by one pixel (the pixels they leave turn black;
  pixels moved off the canvas are dropped).

An image *flips* when at least one of its variants is judged wrong. A correct image whose objects are well inside
every threshold (size, fill ratio, 1.5 px relation margin, separation from the other objects) never flips; a
perfectly clean ground-truth render can still flip when an object is near the minimum size or two objects are
within a pixel or two of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from diffalign.world.verifier import FOREGROUND_THRESHOLD, segment, to_uint8, verify

EDGE_CHANGES = ("grow", "shrink", "left", "right", "up", "down")
_CROSS = ndimage.generate_binary_structure(2, 1)
_SHIFTS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


def edge_change(image: np.ndarray, mask: np.ndarray, change: str) -> np.ndarray:
    """`image` (uint8 `(H, W, 3)`) with the object of boolean `mask` `(H, W)` changed by one pixel; a new array.

    Args:
        change: one of `EDGE_CHANGES` (see the module docstring).

    Raises:
        ValueError: for an unknown `change`, or a mask whose shape is not the image's `(H, W)`.
    """
    if change not in EDGE_CHANGES:
        raise ValueError(f"change must be one of {EDGE_CHANGES}, got {change!r}")
    if mask.shape != image.shape[:2]:
        raise ValueError(f"mask shape {mask.shape} is not the image's (H, W) = {image.shape[:2]}")
    out = image.copy()
    if change == "grow":
        background = image.max(axis=-1) <= FOREGROUND_THRESHOLD
        ring = ndimage.binary_dilation(mask, _CROSS) & ~mask & background
        out[ring] = np.round(image[mask].astype(np.float64).mean(axis=0)).astype(np.uint8)
    elif change == "shrink":
        out[mask & ~ndimage.binary_erosion(mask, _CROSS, border_value=1)] = 0
    else:
        dy, dx = _SHIFTS[change]
        ys, xs = np.nonzero(mask)
        values = image[ys, xs]
        out[ys, xs] = 0
        ny, nx = ys + dy, xs + dx
        keep = (ny >= 0) & (ny < image.shape[0]) & (nx >= 0) & (nx < image.shape[1])
        out[ny[keep], nx[keep]] = values[keep]
    return out


def edge_variants(image: np.ndarray) -> list[tuple[int, str, np.ndarray]]:
    """Every one-pixel edge change of every segmented object of `image` (uint8 `(H, W, 3)` or float in [0, 1]):
    ``(object index in segment order, change, changed uint8 image)``, ``len(EDGE_CHANGES)`` per object."""
    img = to_uint8(image)
    return [(k, change, edge_change(img, mask, change)) for k, (_, mask) in enumerate(segment(img))
            for change in EDGE_CHANGES]


@dataclass
class EdgeFlips:
    """What one-pixel edge changes do to the correct images of a set.

    Attributes:
        n_images: images judged.
        n_correct: images the verifier judges correct (the denominator of `fraction`).
        n_flipped: correct images with at least one variant judged wrong.
        by_change: per change in `EDGE_CHANGES`, how many correct images that change flips (for any object).
        flipped: indices (into the input) of the flipped images.
    """

    n_images: int
    n_correct: int
    n_flipped: int
    by_change: dict[str, int] = field(default_factory=dict)
    flipped: list[int] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """`n_flipped / n_correct` (nan when no image is correct)."""
        return self.n_flipped / self.n_correct if self.n_correct else float("nan")

    @property
    def se(self) -> float:
        """Binomial standard error of `fraction`, ``sqrt(f (1 - f) / n_correct)``."""
        f = self.fraction
        return float(np.sqrt(f * (1 - f) / self.n_correct)) if self.n_correct else float("nan")


def edge_flips(images, specs: list[dict]) -> EdgeFlips:
    """Counts the correct images among `images` that a one-pixel edge change flips to wrong.

    Args:
        images: uint8 `(N, H, W, 3)` (or float in [0, 1]) channels-last images, or a sequence of them.
        specs: the N prompts' GenEval metadata (``{"tag", "include"}``), as `verify` takes.

    Raises:
        ValueError: when the counts of images and specs differ.
    """
    if len(images) != len(specs):
        raise ValueError(f"got {len(images)} images and {len(specs)} specs; pass one spec per image")
    result = EdgeFlips(n_images=len(specs), n_correct=0, n_flipped=0, by_change=dict.fromkeys(EDGE_CHANGES, 0))
    for i, (image, spec) in enumerate(zip(images, specs)):
        if not verify(image, spec).correct:
            continue
        result.n_correct += 1
        broken = {change for _, change, variant in edge_variants(image) if not verify(variant, spec).correct}
        for change in broken:
            result.by_change[change] += 1
        if broken:
            result.n_flipped += 1
            result.flipped.append(i)
    return result
