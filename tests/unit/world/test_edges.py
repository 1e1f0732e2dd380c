"""One-pixel edge changes (diffalign.world.edges): the changes pixel by pixel, and the flip count of hand-made renders
derived by hand from the verifier's thresholds (MIN_AREA 6, square fill > 0.86, relation margin 1.5 px)."""

import numpy as np
import pytest
from conftest import BLUE, RED, world_canvas

from diffalign.world.edges import EDGE_CHANGES, edge_change, edge_flips, edge_variants
from diffalign.world.verifier import parse_caption, verify


def test_each_change_moves_one_pixel_of_edge():
    img = world_canvas(((10, 15, 10, 15), RED))  # 5x5 square at rows/cols 10..14
    mask = img.max(-1) > 0
    grown = edge_change(img, mask, "grow")
    assert (grown.max(-1) > 0).sum() == 25 + 4 * 5  # a 1-px cross dilation adds one row of 5 on each side
    assert tuple(grown[9, 12]) == RED and tuple(grown[9, 9]) == (0, 0, 0)
    shrunk = edge_change(img, mask, "shrink")
    assert (shrunk.max(-1) > 0).sum() == 9 and shrunk[11:14, 11:14].max(-1).min() > 0
    right = edge_change(img, mask, "right")
    ys, xs = np.nonzero(right.max(-1))
    assert (xs.min(), xs.max(), ys.min(), ys.max()) == (11, 15, 10, 14)
    edge = world_canvas(((0, 5, 0, 5), RED))
    ys, xs = np.nonzero(edge_change(edge, edge.max(-1) > 0, "up").max(-1))
    assert (ys.min(), ys.max(), len(ys)) == (0, 3, 20)  # the top row leaves the canvas
    assert len(edge_variants(world_canvas(((10, 15, 10, 15), RED), ((20, 25, 20, 25), BLUE)))) == 2 * len(EDGE_CHANGES)
    with pytest.raises(ValueError, match="change must be one of"):
        edge_change(img, mask, "blur")


def test_flip_fraction_of_hand_made_renders():
    square = parse_caption("a red square")
    position = parse_caption("a blue square right of a red square")
    big = world_canvas(((10, 18, 10, 18), RED))  # 8x8: grown fill 96/100, shrunk 6x6: stays a square -> never flips
    small = world_canvas(((10, 13, 10, 13), RED))  # 3x3 = 9 px >= 6: correct; shrunk to 1 px (< 6) and grown to a
    # 21-px cross in a 5x5 box (fill 0.84 < 0.86: a circle) -> flips under grow and shrink
    near = world_canvas(((5, 10, 10, 15), RED), ((20, 25, 12, 17), BLUE))  # centroids x 12 and 14: 2 > 1.5 px; moving
    # either square by one pixel along x towards the other leaves 1 < 1.5 -> flips under left (blue) / right (red)
    wrong = world_canvas()  # nothing drawn: wrong, not counted
    assert all(verify(im, sp).correct for im, sp in [(big, square), (small, square), (near, position)])
    res = edge_flips([big, small, near, wrong], [square, square, position, square])
    assert (res.n_images, res.n_correct, res.n_flipped, res.flipped) == (4, 3, 2, [1, 2])
    assert res.fraction == pytest.approx(2 / 3) and res.se == pytest.approx((2 / 3 * 1 / 3 / 3) ** 0.5)
    assert res.by_change == {"grow": 1, "shrink": 1, "left": 1, "right": 1, "up": 0, "down": 0}
    with pytest.raises(ValueError, match="one spec per image"):
        edge_flips([big], [])
