"""A pool of the policy's own previous LoRA checkpoints as the reference (SePPO's "random checkpoint replay",
arXiv:2410.05255 Algorithm 1; docs/methods/algorithms.md#seppo-reference-pool).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from diffalign.config.schemas import config_schema
from diffalign.reference.adapter import ReferenceAdapter, SampleCache, check_strategy, require_lora, tensor_bytes

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy


SELECTIONS = ("uniform", "latest", "initial")


def _resolve_selection(selection: str) -> Callable[[int, list[int], torch.Generator], int] | None:
    """`None` for a built-in selection name, else the callable at the import path ``"pkg.mod:func"`` or
    ``"pkg.mod.func"``."""
    if selection in SELECTIONS:
        return None
    module_name, sep, attr = selection.partition(":") if ":" in selection else selection.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reference.selection={selection!r} is neither one of {list(SELECTIONS)} nor an import path such as"
            " 'my_pkg.selection:pick'."
        )
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reference.selection={selection!r} cannot be imported ({err}); check the import path.") from err
    if not callable(func):
        raise TypeError(f"reference.selection={selection!r} is not callable; name a function.")
    return func


@config_schema("reference", "pool")
@dataclass
class PoolReferenceConfig:
    """Config of `PoolReference`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.reference.pool.PoolReference"
    save_every: int = 30
    keep: int = 7
    selection: str = "uniform"
    redraw: str = "stage"
    keep_initial: bool = True
    seed: int = 0
    storage_device: str | None = None


class PoolReference:
    r"""A pool of the policy's previous LoRA checkpoints; the reference θ_r is drawn from it (SePPO,
    arXiv:2410.05255 Algorithm 1, "ref ∼ U(0, k−1)"; docs/methods/algorithms.md#seppo-reference-pool).

    Before update ``u`` (0-based; `on_step(policy, u)`): if ``u % save_every == 0`` the policy's current adapter is
    appended to the pool, so the pool starts with θ_0 (the initial adapter) at ``u = 0``; when it then holds more than
    `keep` snapshots the oldest one is dropped (with `keep_initial`, the oldest after θ_0). Each snapshot starts a
    *selection stage*: an index ``r`` is drawn with `selection` and ``P[r]`` is copied into the reference adapter, where
    it stays until the next draw. With ``redraw="step"`` a new index is drawn before every update instead.

    Selections: ``"uniform"`` (SePPO: r ~ U{0..k−1}, from the pool's own `torch.Generator`), ``"latest"`` (r = k−1, the
    snapshot just taken; SPIN-Diffusion-like), ``"initial"`` (r = 0; DITTO-like), or an import path of a callable
    ``f(num_snapshots: int, snapshot_steps: list[int], generator: torch.Generator) -> int`` returning r in
    ``[0, num_snapshots)``.

    Memory: the pool holds at most `keep` LoRA state dicts of cloned float32 tensors (K × adapter bytes, see
    `stored_bytes`), plus the one reference adapter; no model copy.

    Args:
        save_every (`int`, defaults to 30): updates between snapshots (SePPO: 30), ≥ 1.
        keep (`int`, defaults to 7): maximum snapshots kept, K ≥ 1 (SePPO: 7).
        selection (`str`, defaults to "uniform"): see above.
        redraw (`str`, defaults to "stage"): ``"stage"`` draws once per snapshot (our reading of Algorithm 1, whose
            draw granularity the paper does not state; INFERRED) or ``"step"`` before every update.
        keep_initial (`bool`, defaults to True): never evict θ_0 (so ``"initial"`` stays the pretrained state;
            INFERRED: the paper's run never exceeds K = 7 snapshots).
        seed (`int`, defaults to 0): seed of the selection generator.
        storage_device (`str`, *optional*): where snapshots are kept, e.g. "cpu" to spare GPU memory; default the
            policy's device.

    Raises:
        ValueError: naming the ``reference.*`` field, for `save_every` or `keep` < 1, an unknown `redraw`, or a
            `selection` that is neither built in nor an importable callable; at draw time, if a callable returns an
            index outside the pool (a `TypeError` if it returns no int).
    """

    strategy = "pool"

    def __init__(
        self,
        save_every: int = 30,
        keep: int = 7,
        selection: str = "uniform",
        redraw: str = "stage",
        keep_initial: bool = True,
        seed: int = 0,
        storage_device: str | None = None,
    ):
        if save_every < 1:
            raise ValueError(f"reference.save_every={save_every} must be >= 1 (SePPO: 30).")
        if keep < 1:
            raise ValueError(f"reference.keep={keep} must be >= 1 (SePPO: 7).")
        if redraw not in ("stage", "step"):
            raise ValueError(f"reference.redraw={redraw!r} must be 'stage' or 'step'.")
        self.save_every, self.keep, self.selection, self.redraw = save_every, keep, selection, redraw
        self.keep_initial, self.seed, self.storage_device = keep_initial, seed, storage_device
        self._select = _resolve_selection(selection)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.snapshots: list[dict[str, torch.Tensor]] = []
        self.snapshot_steps: list[int] = []
        self.selected: int | None = None
        self.drawn_at_step: int | None = None
        self.last_step: int | None = None
        self.version = 0
        self.samples = SampleCache()
        self.adapter: ReferenceAdapter | None = None

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Adds the reference adapter (its content is set by the first `on_step`)."""
        require_lora(policy, self.strategy)
        self.adapter = ReferenceAdapter(policy)

    def stored_bytes(self) -> int:
        """Bytes held by the stored snapshots (distinct storages), K × adapter bytes."""
        return tensor_bytes(self.snapshots)

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        """Runs the block with P[selected] active and the UNet in eval mode.

        Raises:
            RuntimeError: if no snapshot was drawn yet (call `on_step(policy, 0)` first).
        """
        if self.selected is None:
            raise RuntimeError("the reference pool is empty; call reference.on_step(policy, global_step) first.")
        with self.adapter.activate():
            yield policy

    def _draw(self) -> int:
        k = len(self.snapshots)
        if self.selection == "uniform":
            return int(torch.randint(0, k, (1,), generator=self.generator).item())
        if self.selection == "latest":
            return k - 1
        if self.selection == "initial":
            return 0
        index = self._select(k, list(self.snapshot_steps), self.generator)
        if not isinstance(index, int):
            raise TypeError(f"reference.selection={self.selection!r} returned {index!r}; it must return an int.")
        if not 0 <= index < k:
            raise ValueError(
                f"reference.selection={self.selection!r} returned {index!r}; it must return an int in [0, {k})."
            )
        return index

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Snapshots and/or re-draws before update `global_step`; returns True when θ_r was (re)drawn. Calling it
        twice for one step does nothing the second time."""
        if global_step == self.last_step:
            return False
        self.last_step = global_step
        new_stage = global_step % self.save_every == 0
        if new_stage:
            self.snapshots.append(self.adapter.snapshot_policy(self.storage_device))
            self.snapshot_steps.append(global_step)
            if len(self.snapshots) > self.keep:
                drop = 1 if self.keep_initial and self.keep > 1 else 0
                del self.snapshots[drop], self.snapshot_steps[drop]
        if not (new_stage or self.redraw == "step"):
            return False
        self.selected = self._draw()
        self.drawn_at_step = global_step
        self.adapter.load(self.snapshots[self.selected], f"pool snapshot {self.selected}")
        self.version += 1
        self.samples.clear()
        return True

    def state_dict(self) -> dict[str, Any]:
        """Pool contents, snapshot steps, the selected index, when it was drawn, the selection RNG and the sample
        cache."""
        return {"strategy": self.strategy, "save_every": self.save_every, "keep": self.keep,
                "selection": self.selection, "redraw": self.redraw, "keep_initial": self.keep_initial,
                "snapshots": list(self.snapshots), "snapshot_steps": list(self.snapshot_steps),
                "selected": self.selected, "drawn_at_step": self.drawn_at_step, "last_step": self.last_step,
                "version": self.version, "generator": self.generator.get_state(),
                "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a `state_dict` (snapshots moved to `storage_device`) and reloads P[selected] into the adapter.

        Raises:
            ValueError: if the saved pool was built with other ``reference.*`` settings.
        """
        check_strategy(state, self.strategy)
        for field in ("save_every", "keep", "selection", "redraw", "keep_initial"):
            if state[field] != getattr(self, field):
                raise ValueError(
                    f"the checkpoint's pool has reference.{field}={state[field]!r}, this run {getattr(self, field)!r};"
                    f" resume with reference.{field}={state[field]!r}."
                )
        device = self.storage_device or self.adapter.unet.device
        self.snapshots = [{k: v.to(device) for k, v in snap.items()} for snap in state["snapshots"]]
        self.snapshot_steps = list(state["snapshot_steps"])
        self.selected, self.drawn_at_step = state["selected"], state["drawn_at_step"]
        self.last_step, self.version = state["last_step"], state["version"]
        self.generator.set_state(state["generator"])
        if self.selected is not None:
            self.adapter.load(self.snapshots[self.selected], f"pool snapshot {self.selected}")
        self.samples.load_state_dict(state["samples"])
