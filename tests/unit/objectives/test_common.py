"""The objectives' shared helpers (`diffalign.objectives.common`), found by mutation testing
(docs/contributing.md#mutation-testing): the per-sample MSE on a case computed by hand, the random draws against
torch's own calls with the same generators (one for the batch, or diffusers' one per sample), the training-timestep
range with its inclusive ends, and every message."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from diffalign.objectives.common import (
    check_timestep_range,
    draw_timesteps_and_noise,
    generator_device,
    per_sample_mse,
    rand,
    randint,
    randn,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_per_sample_mse_by_hand():
    """Sample 0: errors (1, 2, 0, -1) -> (1 + 4 + 0 + 1) / 4 = 1.5; sample 1: errors (3, 0, 0, 0) -> 9 / 4 = 2.25."""
    target = torch.tensor([[[1.0, -1.0], [2.0, 0.5]], [[0.0, 4.0], [-2.0, 1.0]]])
    pred = target + torch.tensor([[[1.0, 2.0], [0.0, -1.0]], [[3.0, 0.0], [0.0, 0.0]]])
    loss = per_sample_mse(pred, target)
    assert loss.shape == (2,) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor([1.5, 2.25]), rtol=0, atol=0)
    # computed in float32: 300² = 90000 overflows fp16 (max 65504) to inf
    half = per_sample_mse(torch.tensor([[300.0, 0.0]]).half(), torch.zeros(1, 2).half())
    assert half.dtype == torch.float32 and half.item() == 45000.0


def test_per_sample_mse_refuses_bad_shapes():
    with pytest.raises(ValueError, match="^" + re.escape(
            "per_sample_mse: pred has shape (2, 3) but target has shape (2, 4); pass a target with the prediction's "
            "shape (see policy.training_target).") + "$"):
        per_sample_mse(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="^" + re.escape(
            "per_sample_mse: inputs are 0-dim; pass tensors with a leading batch dimension (B, ...).") + "$"):
        per_sample_mse(torch.tensor(1.0), torch.tensor(0.0))


def test_generator_device():
    assert generator_device(None) == torch.device("cpu")
    assert generator_device([]) == torch.device("cpu")
    assert generator_device(gen(0)) == torch.device("cpu")
    assert generator_device([gen(0)]) == torch.device("cpu")  # (the first of a list: a list of one has no second)
    assert generator_device((gen(0), gen(1))) == torch.device("cpu")
    # (the device is the generator's: one with another device attribute, as a CUDA generator has)
    elsewhere = SimpleNamespace(device=torch.device("meta"))
    assert generator_device(elsewhere) == torch.device("meta")
    assert generator_device([elsewhere, gen(0)]) == torch.device("meta")
    assert generator_device([gen(0), elsewhere]) == torch.device("cpu")


def test_randn_one_generator_and_one_per_sample():
    """One generator: torch.randn of the whole shape. A list: row i is torch.randn(shape[1:]) of generator i alone."""
    out = randn((3, 2, 2), gen(5))
    assert out.dtype == torch.float32 and out.device == torch.device("cpu")
    torch.testing.assert_close(out, torch.randn((3, 2, 2), generator=gen(5)), rtol=0, atol=0)
    rows = randn((3, 2, 2), [gen(7), gen(8), gen(9)])
    expected = torch.stack([torch.randn((2, 2), generator=gen(s)) for s in (7, 8, 9)])
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    # a row does not depend on the other rows' generators (what a batch split across processes relies on)
    torch.testing.assert_close(randn((1, 2, 2), (gen(8),))[0], rows[1], rtol=0, atol=0)
    assert randn((2, 3), None).shape == (2, 3)


def test_noise_is_float32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert randn((2, 3), gen(0)).dtype == torch.float32
        assert randn((2, 3), [gen(0), gen(1)]).dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)


def test_rand_draws_float32_values_whatever_the_default_dtype():
    """Under a float64 default, `rand` draws what ``torch.rand(..., dtype=torch.float32)`` draws from the same
    generator (a float64 draw gives other values), for one generator and one per sample."""
    expected = torch.rand(4, generator=gen(5), dtype=torch.float32)
    expected_rows = torch.cat([torch.rand(1, generator=gen(s), dtype=torch.float32) for s in (6, 7)])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert not torch.equal(torch.rand(4, generator=gen(5)).float(), expected)  # (the float64 stream differs)
        out, rows = rand(4, gen(5)), rand(2, [gen(6), gen(7)])
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == rows.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(rows, expected_rows, rtol=0, atol=0)


def test_randint_one_generator_and_one_per_sample():
    out = randint(3, 11, 6, gen(1))
    assert out.dtype == torch.long and out.shape == (6,)
    torch.testing.assert_close(out, torch.randint(3, 11, (6,), generator=gen(1)), rtol=0, atol=0)
    rows = randint(3, 11, 3, [gen(4), gen(5), gen(6)])
    expected = torch.cat([torch.randint(3, 11, (1,), generator=gen(s)) for s in (4, 5, 6)])
    assert rows.dtype == torch.long and rows.shape == (3,)
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)
    # [low, high): a range of one value gives it every time
    assert randint(7, 8, 4, gen(0)).tolist() == [7, 7, 7, 7]
    assert randint(7, 8, 2, [gen(0), gen(1)]).tolist() == [7, 7]


def test_rand_one_generator_and_one_per_sample():
    out = rand(5, gen(2))
    assert out.dtype == torch.float32 and out.shape == (5,)
    torch.testing.assert_close(out, torch.rand(5, generator=gen(2)), rtol=0, atol=0)
    rows = rand(2, (gen(3), gen(4)))
    torch.testing.assert_close(rows, torch.cat([torch.rand(1, generator=gen(s)) for s in (3, 4)]), rtol=0, atol=0)


def test_a_list_needs_one_generator_per_sample():
    message = ("got 2 generators for a batch of 3; pass one torch.Generator per sample (or a single one for the whole "
               "batch)")
    for draw in (lambda g: randn((3, 1), g), lambda g: randint(0, 5, 3, g), lambda g: rand(3, g)):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            draw([gen(0), gen(1)])


def policy_with(num_train_timesteps: int):
    return SimpleNamespace(scheduler=SimpleNamespace(config=SimpleNamespace(num_train_timesteps=num_train_timesteps)))


def test_draw_timesteps_and_noise_draws_t_then_noise_inclusive_range():
    """t ~ U{min..max} (both ends included: torch.randint(min, max + 1)), then ε, in that order from the generator."""
    policy = policy_with(10)
    t, noise = draw_timesteps_and_noise(policy, (4, 2, 3), 2, 6, gen(11))
    g = gen(11)
    expected_t = torch.randint(2, 7, (4,), generator=g)
    expected_noise = torch.randn((4, 2, 3), generator=g)
    torch.testing.assert_close(t, expected_t, rtol=0, atol=0)
    torch.testing.assert_close(noise, expected_noise, rtol=0, atol=0)
    assert t.dtype == torch.long and noise.dtype == torch.float32
    # max None is the scheduler's last timestep, 9: min = 9 gives 9 (and max = 9 is allowed)
    assert draw_timesteps_and_noise(policy, (3, 1), 9, None, gen(0))[0].tolist() == [9, 9, 9]
    assert draw_timesteps_and_noise(policy, (3, 1), 9, 9, gen(0))[0].tolist() == [9, 9, 9]
    assert draw_timesteps_and_noise(policy, (2, 1), 4, 4, gen(0))[0].tolist() == [4, 4]
    # one generator per sample: sample i's t and ε from generator i only
    t_rows, noise_rows = draw_timesteps_and_noise(policy, (2, 3), 0, None, [gen(20), gen(21)])
    for i, seed in enumerate((20, 21)):
        g = gen(seed)
        assert t_rows[i].item() == torch.randint(0, 10, (1,), generator=g).item()
        torch.testing.assert_close(noise_rows[i], torch.randn((3,), generator=g), rtol=0, atol=0)


def test_draw_timesteps_and_noise_refuses_a_max_outside_the_schedule():
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.timestep_max=10 is outside the scheduler's range 0..9; lower it or set it to null.") + "$"):
        draw_timesteps_and_noise(policy_with(10), (1, 1), 0, 10, gen(0))


def test_check_timestep_range():
    check_timestep_range(SimpleNamespace(timestep_min=0, timestep_max=None))
    check_timestep_range(SimpleNamespace(timestep_min=5, timestep_max=5))
    check_timestep_range(SimpleNamespace(timestep_min=5, timestep_max=None))
    with pytest.raises(ValueError, match=r"^method\.timestep_min=-1 must be >= 0\.$"):
        check_timestep_range(SimpleNamespace(timestep_min=-1, timestep_max=None))
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.timestep_max=4 is below method.timestep_min=5; set timestep_max >= timestep_min, or null for the "
            "scheduler's last timestep.") + "$"):
        check_timestep_range(SimpleNamespace(timestep_min=5, timestep_max=4))
