"""Preference pairs (ties and winner order) and the resumable sampler (mid-epoch resume);
docs/guides/field_cases.md."""

import logging

import numpy as np
import pytest
import torch
from conftest import colour_of

from diffalign.data.preference import PreferencePairs, ResumableSampler

COLOURS_A = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
COLOURS_B = [(0, 255, 255), (255, 0, 255), (128, 128, 128), (10, 20, 30)]


def solid(rgb) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, np.uint8), (8, 8, 3)).copy()


def rows(labels):
    return [
        {"prompt": f"p{i}", "image_0": solid(COLOURS_A[i % 4]), "image_1": solid(COLOURS_B[i % 4]), "label_0": label}
        for i, label in enumerate(labels)
    ]


# ------------------------------------------------------------------------------------------ ties and winner order


def test_ties_are_dropped_and_the_winner_comes_first(caplog):
    with caplog.at_level(logging.INFO, logger="diffalign.data.preference"):
        data = PreferencePairs(rows([1, 0, 0.5, 1]))
    assert len(data) == 3 and data.num_ties_dropped == 1 and data.ties == []
    assert "1 tie dropped" in caplog.text
    assert [data[i][3] for i in range(3)] == [0, 1, 3]  # ids are row indices

    prompt, win, lose, row_id = data[1]  # label_0 = 0: image_1 wins
    assert (prompt, row_id) == ("p1", 1)
    assert colour_of(win) == COLOURS_B[1] and colour_of(lose) == COLOURS_A[1]
    prompt, win, lose, row_id = data[0]  # label_0 = 1: image_0 wins
    assert colour_of(win) == COLOURS_A[0] and colour_of(lose) == COLOURS_B[0]
    assert win.shape == (3, 8, 8) and win.dtype == torch.float32


@pytest.mark.parametrize("bad", [0.3, 2, -1, float("nan"), "1", None, True])
def test_invalid_label_raises_naming_the_row(bad):
    with pytest.raises(ValueError, match=r"row 2 has label_0="):
        PreferencePairs(rows([1, 0, bad, 1]))


def test_keep_ties_never_makes_a_tie_a_win():
    data = PreferencePairs(rows([np.float32(1), np.int64(0), np.float64(0.5), 1]), keep_ties=True)
    assert len(data) == 3 and [data[i][3] for i in range(3)] == [0, 1, 3]
    assert data.num_ties == 1 and data.num_ties_dropped == 0
    ((prompt, image_0, image_1, row_id),) = data.ties
    assert (prompt, row_id) == ("p2", 2)
    assert np.array_equal(image_0, solid(COLOURS_A[2])) and np.array_equal(image_1, solid(COLOURS_B[2]))


def test_missing_key_and_bad_images():
    with pytest.raises(ValueError, match=r"row 0 lacks keys \['label_0'\]"):
        PreferencePairs([{"prompt": "p", "image_0": solid((0, 0, 0)), "image_1": solid((0, 0, 0))}])
    data = PreferencePairs(
        [{"prompt": "p", "image_0": torch.full((3, 4, 4), 2.0), "image_1": torch.zeros(3, 4, 4), "label_0": 1}]
    )
    with pytest.raises(ValueError, match=r"row 0 winner.*\[0, 1\]"):
        data[0]
    data = PreferencePairs(
        [{"prompt": "p", "image_0": np.zeros((4, 4, 3)), "image_1": solid((1, 1, 1)), "label_0": 0}]
    )
    with pytest.raises(ValueError, match="row 0 loser.*uint8"):
        data[0]


def test_tensor_images_and_collate():
    tensor_image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))
    data = PreferencePairs(
        [
            {"prompt": "a", "image_0": tensor_image, "image_1": solid((255, 0, 0)), "label_0": 1.0},
            {"prompt": "b", "image_0": solid((0, 0, 0)), "image_1": solid((0, 0, 255)), "label_0": 0},
        ]
    )
    batch = data.collate([1, 0])
    assert batch["prompts"] == ["b", "a"] and batch["ids"].tolist() == [1, 0]
    assert batch["images_w"].shape == (2, 3, 8, 8) and batch["images_w"].dtype == torch.float32
    assert torch.equal(batch["images_w"][1], tensor_image)
    assert colour_of(batch["images_w"][0]) == (0, 0, 255) and colour_of(batch["images_l"][1]) == (255, 0, 0)


# ---------------------------------------------------------------------------------------------- mid-epoch resume


def run(sampler: ResumableSampler, data: PreferencePairs, num_epochs: int, stop_after: int | None = None):
    """The training loop's data path; returns the id batches per step and stops after `stop_after` steps."""
    steps = []
    while sampler.epoch < num_epochs:
        for indices in sampler:
            steps.append([data[i][3] for i in indices])
            if stop_after is not None and len(steps) == stop_after:
                return steps
    return steps


def test_resumed_sampler_replays_the_same_batches():
    data = PreferencePairs(rows([1, 0] * 5))  # 10 pairs, ids 0..9
    run_a = run(ResumableSampler(10, batch_size=2, seed=7), data, num_epochs=2)
    assert len(run_a) == 10

    first = ResumableSampler(10, batch_size=2, seed=7)
    run_b = run(first, data, num_epochs=2, stop_after=3)
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 3}
    resumed = ResumableSampler(10, batch_size=2, seed=7)
    resumed.load_state_dict(state)
    run_b += run(resumed, data, num_epochs=2)

    assert run_b[3:] == run_a[3:] and run_b == run_a
    for epoch in range(2):
        ids = [i for batch in run_a[5 * epoch : 5 * epoch + 5] for i in batch]
        assert sorted(ids) == list(range(10))
    expected_epoch0 = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    assert [i for batch in run_a[:5] for i in batch] == expected_epoch0
    assert run_a[:5] != run_a[5:]  # epoch 1 uses seed + 1


def test_sampler_resumes_at_an_epoch_boundary():
    data = PreferencePairs(rows([1] * 10))
    run_a = run(ResumableSampler(10, 2, seed=7), data, num_epochs=2)
    first = ResumableSampler(10, 2, seed=7)
    run_b = run(first, data, num_epochs=2, stop_after=5)  # last batch of epoch 0, epoch not yet advanced
    assert first.state_dict() == {"epoch": 0, "position": 5}
    resumed = ResumableSampler(10, 2, seed=7)
    resumed.load_state_dict(first.state_dict())
    assert run_b + run(resumed, data, num_epochs=2) == run_a


def test_next_batch_after_resume_matches_iteration():
    reference = ResumableSampler(10, 2, seed=7)
    expected = [batch for _ in range(3) for batch in reference]  # 3 epochs by iteration
    first = ResumableSampler(10, 2, seed=7)
    got = [first.next_batch() for _ in range(7)]
    resumed = ResumableSampler(10, 2, seed=7)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"epoch": 1, "position": 2}
    got += [resumed.next_batch() for _ in range(8)]
    assert got == expected


def test_sampler_sizes_and_validation():
    assert len(ResumableSampler(10, 3, seed=0)) == 3
    no_drop = ResumableSampler(10, 3, seed=0, shuffle=False, drop_last=False)
    assert len(no_drop) == 4 and list(no_drop) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert no_drop.state_dict() == {"epoch": 1, "position": 0}
    with pytest.raises(ValueError, match="batch_size=4 exceeds num_items=3"):
        ResumableSampler(3, 4, seed=0)
    with pytest.raises(ValueError, match="num_items"):
        ResumableSampler(0, 1, seed=0)
    with pytest.raises(ValueError, match="batch size or data changed"):
        ResumableSampler(10, 2, seed=0).load_state_dict({"epoch": 0, "position": 6})
    with pytest.raises(ValueError, match="keys"):
        ResumableSampler(10, 2, seed=0).load_state_dict({"epoch": 0})
