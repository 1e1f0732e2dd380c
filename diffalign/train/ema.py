"""An exponential moving average of the trained parameters, for evaluation and the exported LoRA (``online.ema``).

Flow-GRPO's released training scripts (`scripts/train_sd3.py`, `flow_grpo/ema.py`), and DGPO's built on them, keep
an EMA of the LoRA parameters beside the trained ones, evaluate with it and save it as the checkpoint's LoRA: decay
0.9, updated every 8th optimizer step, its decay warmed up as

    d_t = min((1 + t) / (10 + t), decay),        ema ← ema + (1 − d_t) (θ − ema)   when (t + 1) mod interval = 0,

with t the optimizer steps done (`ALGORITHMS.md`, DGPO (c): "separate evaluation EMA (decay 0.9, every 8 steps)").
Training itself never reads it: rollouts, the loss and the checkpoints' resumable weights stay the live ones.

One difference from the released loop: it calls the EMA's step once per training micro-batch with the optimizer's
step count, so in each 8th optimizer step the EMA is updated once per micro-batch of that step; here it is updated
once per optimizer step (the formula above, applied once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class ParameterEma:
    """The EMA of `params` (the optimizer's trainable tensors, in order).

    Args:
        params (`Iterable[torch.nn.Parameter]`): the trained parameters; copied at construction (the EMA starts at
            the initial weights: for a LoRA, B = 0).
        decay (`float`, defaults to 0.9): the cap of d_t, in [0, 1) (0.9 in Flow-GRPO's and DGPO's code).
        update_interval (`int`, defaults to 8): update when (t + 1) is a multiple of it (≥ 1; 8 in the code).

    Raises:
        ValueError: out-of-range `decay` or `update_interval` (naming the ``online.`` field).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], decay: float = 0.9, update_interval: int = 8):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"online.ema_decay={decay} must be in [0, 1) (0.9 in Flow-GRPO's and DGPO's code)")
        if int(update_interval) != update_interval or update_interval < 1:
            raise ValueError(f"online.ema_update_interval={update_interval} must be an integer >= 1 (8 in the code)")
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay, self.update_interval = float(decay), int(update_interval)

    def current_decay(self, step: int) -> float:
        """d_t = min((1 + t) / (10 + t), decay) at `step` = t optimizer steps done."""
        return min((1.0 + step) / (10.0 + step), self.decay)

    @torch.no_grad()
    def after_update(self, step: int) -> bool:
        """Called after each optimizer step with `step` = the steps done: ema ← ema + (1 − d_t)(θ − ema) when
        (step + 1) is a multiple of ``update_interval``. Returns whether it updated."""
        if (step + 1) % self.update_interval:
            return False
        weight = 1.0 - self.current_decay(step)
        for s, p in zip(self.shadow, self.params, strict=True):
            s.add_(p.detach().to(s.dtype) - s, alpha=weight)
        return True

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Runs the block with the EMA in the parameters (the live ones are put back after, also on an error)."""
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, live, strict=True):
                    p.copy_(v)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": [s.detach().clone() for s in self.shadow], "decay": self.decay,
                "update_interval": self.update_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError("the checkpoint's online.ema weights do not match this run's trainable parameters (another "
                             "LoRA rank or target modules?); resume with the settings the run was started with")
        with torch.no_grad():
            for s, v in zip(self.shadow, shadow, strict=True):
                s.copy_(v)
