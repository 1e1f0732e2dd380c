"""Distances to the verifier's thresholds (diffalign.world.thresholds) on hand-made images, each value derived by hand
from the verifier's rules (MIN_AREA 6, square fill > 0.86, nearest palette colour, 4-connected components, relation
margin 1.5 px) and the palette's RGB values."""

import math

import pytest
from conftest import BLUE, RED, world_canvas

from diffalign.world.edges import edge_change
from diffalign.world.thresholds import edge_flip_causes, explain_change, object_margins, relation_margins, stray_pixels
from diffalign.world.verifier import parse_caption


def test_object_margins_of_a_clean_square_and_a_pair():
    (sq,) = object_margins(world_canvas(((10, 15, 10, 15), RED)))  # 5x5 in the palette's exact red
    assert (sq.shape, sq.color, sq.area, sq.half_size, sq.fill, sq.gap) == ("square", "red", 25, 2.0, 1.0, math.inf)
    assert sq.fill_margin == pytest.approx(0.14) and sq.color_distance == pytest.approx(0.0)
    # nearest other palette entry of red (220, 40, 40) is yellow (230, 215, 40): sqrt(10² + 175²)
    assert sq.color_margin == pytest.approx(math.hypot(10, 175), rel=1e-5)
    # two red 3x3 squares, columns 10-12 and 14-16: one background column between (Manhattan distance 2 -> gap 1)
    pair = object_margins(world_canvas(((10, 13, 10, 13), RED), ((10, 13, 14, 17), RED)))
    assert [o.gap for o in pair] == [1.0, 1.0] and [o.half_size for o in pair] == [1.0, 1.0]
    # an orange-ish square: 85 from red (dG 85) against 90.1 from yellow (dR 5, dG 90): the margin is their difference
    (orange,) = object_margins(world_canvas(((10, 15, 10, 15), (225, 125, 40))))
    assert orange.color == "red" and orange.color_distance == pytest.approx(math.hypot(5, 85), rel=1e-5)
    assert orange.color_margin == pytest.approx(math.hypot(5, 90) - math.hypot(5, 85), rel=1e-4)


def test_stray_pixels_and_relation_margins():
    img = world_canvas(((10, 15, 10, 15), RED), ((25, 27, 25, 27), BLUE))  # a 2x2 blue blob: 4 px < 6, dropped
    assert stray_pixels(img) == 4 and stray_pixels(world_canvas(((10, 15, 10, 15), RED))) == 0
    near = world_canvas(((5, 10, 10, 15), RED), ((20, 25, 12, 17), BLUE))  # centroids x 12 and 14
    assert relation_margins(near, parse_caption("a blue square right of a red square")) == [pytest.approx(0.5)]
    assert relation_margins(near, parse_caption("a blue square below a red square")) == [pytest.approx(13.5)]


def test_explain_change_names_the_threshold_crossed():
    square = parse_caption("a red square")
    small = world_canvas(((10, 13, 10, 13), RED))  # 3x3 = 9 px: correct
    mask = small.max(-1) > 0
    # grown: a 21-px cross in a 5x5 box, fill 0.84 < 0.86; shrunk: 1 px < 6
    assert explain_change(small, edge_change(small, mask, "grow"), square) == "shape square→circle at fill 0.86"
    assert explain_change(small, edge_change(small, mask, "shrink"), square) == "object lost: area < 6"
    assert sorted(edge_flip_causes(small, square)) == [(0, "grow", "shape square→circle at fill 0.86"),
                                                       (0, "shrink", "object lost: area < 6")]
    two = parse_caption("two red squares")
    pair = world_canvas(((10, 15, 10, 15), RED), ((10, 15, 16, 21), RED))  # one background column between
    grown = edge_change(pair, pair.max(-1) > 0, "grow")  # both grow here; the column fills and they merge
    assert explain_change(pair, grown, two) == "merge"
    yellowish = world_canvas(((10, 15, 10, 15), (225, 130, 40)))  # now 85.1 from yellow, 90.1 from red
    assert explain_change(world_canvas(((10, 15, 10, 15), (225, 125, 40))), yellowish, square) == "colour red→yellow"
    near = world_canvas(((5, 10, 10, 15), RED), ((20, 25, 12, 17), BLUE))
    position = parse_caption("a blue square right of a red square")
    moved = world_canvas(((5, 10, 11, 16), RED), ((20, 25, 12, 17), BLUE))  # red one pixel right: 1 < 1.5
    assert explain_change(near, moved, position) == "relation margin 1.5 px"
    assert explain_change(near, near, position) == "still correct"
    extra = world_canvas(((10, 15, 10, 15), RED), ((25, 28, 25, 28), RED))
    assert explain_change(world_canvas(((10, 15, 10, 15), RED)), extra, square) == "extra object"
    assert edge_flip_causes(world_canvas(), square) == []  # not correct: nothing to explain
