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
    """The EMA of `params` (the optimizer's trainable tensors, in order), kept by diffusers' `EMAModel` (whose decay
    without warm-up is exactly min((1 + t) / (10 + t), decay), the formula Flow-GRPO copied), updated every
    `update_interval` optimizer steps.

    Args:
        params (`Iterable[torch.nn.Parameter]`): the trained parameters; copied at construction (the EMA starts at
            the initial weights: for a LoRA, B = 0).
        decay (`float`, defaults to 0.9): the cap of d_t, in [0, 1) (0.9 in Flow-GRPO's and DGPO's code).
        update_interval (`int`, defaults to 8): update when (t + 1) is a multiple of it (≥ 1; 8 in the code).

    Raises:
        ValueError: out-of-range `decay` or `update_interval` (naming the ``online.`` field).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], decay: float = 0.9, update_interval: int = 8):
        from diffusers.training_utils import EMAModel

        if not 0.0 <= decay < 1.0:
            raise ValueError(f"online.ema_decay={decay} must be in [0, 1) (0.9 in Flow-GRPO's and DGPO's code)")
        if int(update_interval) != update_interval or update_interval < 1:
            raise ValueError(f"online.ema_update_interval={update_interval} must be an integer >= 1 (8 in the code)")
        self.params = list(params)
        self.update_interval = int(update_interval)
        self._ema = EMAModel(self.params, decay=float(decay), min_decay=0.0, update_after_step=0,
                             use_ema_warmup=False)

    @property
    def shadow(self) -> list[torch.Tensor]:
        """The EMA tensors, in the order of `params`."""
        return self._ema.shadow_params

    def current_decay(self, step: int) -> float:
        """d_t = min((1 + t) / (10 + t), decay) at `step` = t ≥ 1 optimizer steps done (`EMAModel.get_decay` at its
        counter t + 1)."""
        return self._ema.get_decay(step + 1)

    def after_update(self, step: int) -> bool:
        """Called after each optimizer step with `step` = the steps done: ema ← ema + (1 − d_t)(θ − ema) when
        (step + 1) is a multiple of ``update_interval``. Returns whether it updated."""
        if (step + 1) % self.update_interval:
            return False
        # EMAModel counts its own updates (+1 per call) and decays by that count; here every `update_interval`-th
        # optimizer step updates it, with d_t of the optimizer's step t: set its counter so the call lands on t + 1
        self._ema.optimization_step = step
        self._ema.step(self.params)
        return True

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Runs the block with the EMA in the parameters (the live ones are put back after, also on an error)."""
        self._ema.store(self.params)
        self._ema.copy_to(self.params)
        try:
            yield
        finally:
            self._ema.restore(self.params)

    def state_dict(self) -> dict[str, Any]:
        return self._ema.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow_params"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            raise ValueError("the checkpoint's online.ema weights do not match this run's trainable parameters (another "
                             "LoRA rank or target modules?); resume with the settings the run was started with")
        # (read back on the CPU: onto the devices and dtypes of this run's EMA, as EMAModel keeps the list it is given)
        self._ema.load_state_dict({**state, "shadow_params": [v.to(s.device, s.dtype)
                                                             for v, s in zip(shadow, self.shadow, strict=True)]})
