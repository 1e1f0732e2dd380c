"""`ParameterEma` (``online.ema``) against Flow-GRPO's released EMA, by hand: d_t = min((1 + t) / (10 + t), decay),
ema ← ema + (1 − d_t)(θ − ema) when (t + 1) mod interval = 0, t the optimizer steps done."""

from __future__ import annotations

import pytest
import torch

from diffalign.train.ema import ParameterEma


def test_the_updates_follow_the_released_formula_by_hand():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    ema = ParameterEma([p], decay=0.9, update_interval=2)
    # θ after each step t = 1..6: 1, 2, ..., 6. Updates at t = 1, 3, 5 ((t + 1) even):
    # t=1: d = 2/11, ema = 0 + (9/11)(1 - 0) = 9/11
    # t=3: d = 4/13, ema = 9/11 + (9/13)(3 - 9/11)
    # t=5: d = 6/15 = 0.4, ema = e3 + 0.6 (5 - e3)
    e1 = 9 / 11
    e3 = e1 + (9 / 13) * (3 - e1)
    e5 = e3 + 0.6 * (5 - e3)
    updated = []
    for t in range(1, 7):
        with torch.no_grad():
            p.fill_(float(t))
        updated.append(ema.after_update(t))
    assert updated == [True, False, True, False, True, False]
    assert ema.shadow[0].item() == pytest.approx(e5, rel=1e-6)
    assert ema.current_decay(1000) == 0.9  # the cap, once (1 + t)/(10 + t) passes it


def test_swapped_in_puts_the_ema_in_and_the_live_weights_back_even_on_an_error():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = ParameterEma([p], decay=0.5, update_interval=1)  # shadow = the initial weights
    with torch.no_grad():
        p.add_(10.0)
    with pytest.raises(RuntimeError), ema.swapped_in():
        assert p.tolist() == [1.0, 2.0]
        raise RuntimeError("evaluation failed")
    assert p.tolist() == [11.0, 12.0]


def test_state_round_trip_and_a_mismatched_checkpoint_is_refused():
    p = torch.nn.Parameter(torch.tensor([3.0]))
    a = ParameterEma([p], decay=0.9, update_interval=1)
    with torch.no_grad():
        p.fill_(5.0)
    a.after_update(4)
    b = ParameterEma([torch.nn.Parameter(torch.tensor([0.0]))])
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.shadow[0], b.shadow[0])
    with pytest.raises(ValueError, match="do not match"):
        ParameterEma([torch.nn.Parameter(torch.zeros(2))]).load_state_dict(a.state_dict())


@pytest.mark.parametrize(("decay", "interval", "field"), [(1.0, 8, "ema_decay"), (-0.1, 8, "ema_decay"),
                                                          (0.9, 0, "ema_update_interval")])
def test_out_of_range_settings_name_the_field(decay, interval, field):
    with pytest.raises(ValueError, match=f"online.{field}"):
        ParameterEma([torch.nn.Parameter(torch.zeros(1))], decay=decay, update_interval=interval)
