"""Reference models for preference objectives: frozen base, a named checkpoint, an EMA of the policy, or a pool of the
policy's own previous checkpoints (SePPO's "random checkpoint replay").

Every strategy has the same small API, used by the training loop and by any objective:

```python
reference = PoolReference(save_every=30, keep=7, selection="uniform")
reference.setup(policy)                        # once, before the optimizer is built
for step in range(max_steps):
    reference.on_step(policy, step)             # snapshot / re-draw θ_r when due
    with torch.no_grad(), reference.use(policy):
        ref_pred = policy.predict(...)          # runs θ_r
    ...
state = reference.state_dict()                  # saved with every training checkpoint, restored on resume
```

Apart from the frozen base (the LoRA adapter disabled), the reference weights live in a second peft LoRA adapter on the
policy's UNet, named ``"reference"`` (`ReferenceAdapter`): its tensors are the policy adapter's shape, own their storage,
never require grad, and are made active only inside ``use(policy)``, which also puts the UNet in eval mode. The pool
stores LoRA state dicts (cloned tensors), never model copies, so K stored references cost K × (adapter bytes) plus the
one reference adapter; a full-UNet fine-tune (``model.lora_rank=null``) is rejected at `setup`.

Each strategy also carries a `SampleCache` (``reference.samples``): samples that objectives such as SePPO generate with
the reference, valid while the reference does not change (one *selection stage*); it is emptied at every change and
saved with the checkpoints. ``reference.version`` counts the changes.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from diffalign.schemas import config_schema

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy

POLICY_ADAPTER = "default"
REFERENCE_ADAPTER = "reference"
SELECTIONS = ("uniform", "latest", "initial")
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def _adapter_key(name: str) -> tuple[str, str] | None:
    """``"....to_q.lora_A.default.weight"`` → ``("default", "....to_q.lora_A.weight")``; `None` for non-LoRA names."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3].startswith("lora_"):
        return parts[-2], ".".join(parts[:-2] + parts[-1:])
    return None


def _require_lora(policy: StableDiffusionPolicy, strategy: str) -> None:
    if policy.lora_rank is None:
        raise ValueError(
            f"reference={strategy} needs a LoRA policy, but model.lora_rank is null (full UNet fine-tune). Set"
            " model.lora_rank (e.g. 64): the reference strategies keep LoRA weights, not UNet copies."
        )


def tensor_bytes(tensors: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind `tensors` (a state dict or a list of them); views of one storage count
    once."""
    dicts = tensors if isinstance(tensors, list) else [tensors]
    storages = {}
    for state in dicts:
        for tensor in state.values():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class ReferenceAdapter:
    """A second LoRA adapter (``"reference"``) on the policy's UNet that holds the reference weights θ_r.

    It copies the policy adapter's peft config (rank, alpha, target modules), so a LoRA state dict of the policy fits
    it. Its parameters are float32, never require grad and are not in `policy.trainable_parameters()`. Adding it does
    not touch the global RNG (the throw-away initialisation runs under `torch.random.fork_rng`).

    State dicts here are keyed like peft's without the adapter name, e.g.
    ``"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"``.

    Args:
        policy (`StableDiffusionPolicy`): a LoRA policy with its adapter named ``"default"``.

    Raises:
        ValueError: if the policy already has a ``"reference"`` adapter. (The strategies' `setup` rejects a policy
            without LoRA before building this.)
    """

    def __init__(self, policy: StableDiffusionPolicy, adapter_name: str = REFERENCE_ADAPTER):
        unet = policy.denoiser
        if adapter_name in unet.peft_config:
            raise ValueError(
                f"the policy's denoiser already has a {adapter_name!r} adapter; call reference.setup(policy) once."
            )
        self.adapter_name = adapter_name
        policy_flags = {id(p): p.requires_grad for p in unet.parameters()}
        devices = [unet.device.index or 0] if unet.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter is the point
            # diffusers' add_adapter makes the new adapter the active one; switch straight back to the policy's
            unet.add_adapter(copy.deepcopy(unet.peft_config[POLICY_ADAPTER]), adapter_name=adapter_name)
        unet.set_adapter(POLICY_ADAPTER)
        self.policy_params: dict[str, torch.nn.Parameter] = {}
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, param in unet.named_parameters():
            parsed = _adapter_key(name)
            if parsed is None:
                continue
            adapter, key = parsed
            if adapter == adapter_name:
                param.data = param.data.to(torch.float32)
                param.requires_grad_(False)
                self.params[key] = param
            elif adapter == POLICY_ADAPTER:
                self.policy_params[key] = param
        for param in unet.parameters():  # restore the policy's flags that set_adapter may have flipped
            if id(param) in policy_flags:
                param.requires_grad_(policy_flags[id(param)])
        if set(self.params) != set(self.policy_params) or not self.params:
            raise ValueError("the reference adapter's LoRA tensors do not mirror the policy adapter's; is peft >= 0.17?")
        self.unet = unet
        self.layers = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]

    @property
    def nbytes(self) -> int:
        """Bytes of the reference adapter's tensors (one adapter)."""
        return tensor_bytes(dict(self.params))

    @torch.no_grad()
    def snapshot_policy(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Detached float32 clones of the policy adapter's current tensors (own storage), on `device` (default: the
        policy's)."""
        return {k: p.detach().to(device=device or p.device, dtype=torch.float32, copy=True)
                for k, p in self.policy_params.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Copies `state` (keys and shapes of the policy adapter) into the reference adapter, in place.

        Raises:
            ValueError: naming `source` if keys or shapes differ from the policy adapter's.
        """
        if set(state) != set(self.params):
            missing, unexpected = sorted(set(self.params) - set(state)), sorted(set(state) - set(self.params))
            raise ValueError(
                f"{source}: LoRA keys do not match the policy adapter (missing {missing[:2]}, unexpected "
                f"{unexpected[:2]}); it must come from a run with the same model.lora_rank and lora_target_modules."
            )
        for key, param in self.params.items():
            if state[key].shape != param.shape:
                raise ValueError(
                    f"{source}: LoRA tensor {key!r} has shape {tuple(state[key].shape)}, the policy adapter has "
                    f"{tuple(param.shape)}; use the same model.lora_rank."
                )
            param.copy_(state[key])

    @torch.no_grad()
    def lerp_towards_policy(self, weight: float) -> None:
        """θ_r ← θ_r + weight · (θ − θ_r) on every LoRA tensor (an EMA step with decay 1 − weight)."""
        for key, param in self.params.items():
            param.lerp_(self.policy_params[key].detach().float(), weight)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Runs the UNet with the reference adapter instead of the policy's, in eval mode; both are restored on exit
        (also when the block raises). peft's `set_adapter` marks the activated adapter trainable, so every LoRA
        tensor's `requires_grad` is put back right after the switch: the reference never requires grad."""
        flags = {key: p.requires_grad for key, p in self.policy_params.items()}
        was_training = self.unet.training

        def switch(name: str) -> None:
            for layer in self.layers:
                layer.set_adapter(name)
            for key, param in self.params.items():
                param.requires_grad_(False)
                self.policy_params[key].requires_grad_(flags[key])

        switch(self.adapter_name)
        self.unet.eval()
        try:
            yield
        finally:
            switch(POLICY_ADAPTER)
            self.unet.train(was_training)


class SampleCache:
    """Samples generated by the current reference, by key (a prompt or a data id), on CPU; emptied by the reference
    strategy whenever θ_r changes. Memory: one latent per key (64 KiB for a 4×64×64 float32 SD1.5 latent)."""

    def __init__(self):
        self.items: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        self.items.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"keys": list(self.items), "values": dict(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = {key: state["values"][key].clone() for key in state["keys"]}


def _check_strategy(state: dict[str, Any], strategy: str) -> None:
    if state.get("strategy") != strategy:
        raise ValueError(
            f"the checkpoint's reference state is for reference={state.get('strategy')!r}, this run uses "
            f"reference={strategy!r}; resume with the run's original reference config."
        )


# ---------------------------------------------------------------------------------------------------- strategies


@config_schema("reference", "frozen_base")
@dataclass
class FrozenBaseReferenceConfig:
    """Config of `FrozenBaseReference` (no fields)."""

    _target_: str = "diffalign.reference.FrozenBaseReference"


class FrozenBaseReference:
    """The frozen base model: the policy with its LoRA adapter disabled (`policy.reference()`), the reference of
    Diffusion-DPO (arXiv:2311.12908 §4) and of DITTO-like "ref = θ_0" runs when the LoRA starts at zero. Holds no
    tensors; `on_step` never changes it (``version`` stays 0)."""

    strategy = "frozen_base"

    def __init__(self):
        self.version = 0
        self.samples = SampleCache()

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Checks the policy has a LoRA adapter to disable.

        Raises:
            ValueError: for a full-UNet fine-tune (``model.lora_rank=null``).
        """
        _require_lora(policy, self.strategy)

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        """Runs the block with the adapter disabled and the UNet in eval mode."""
        was_training = policy.denoiser.training
        with policy.reference():
            policy.denoiser.eval()
            try:
                yield policy
            finally:
                policy.denoiser.train(was_training)

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Nothing to do; returns False (the reference never changes)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "version": self.version, "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_strategy(state, self.strategy)
        self.samples.load_state_dict(state["samples"])


@config_schema("reference", "checkpoint")
@dataclass
class CheckpointReferenceConfig:
    """Config of `CheckpointReference`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.reference.CheckpointReference"
    path: str = "???"


class CheckpointReference:
    """A named LoRA as the reference: the base model plus that LoRA (not the adapter-disabled base). The path is a
    diffalign ``checkpoint-<step>/`` or ``final/`` folder, a diffusers LoRA folder or file, or a kohya-format
    ``.safetensors`` file (`diffalign.lora_io.read_lora`), with the policy's rank, alpha and target modules — e.g. the
    run's ``model.init_lora``, which makes the policy start equal to its reference (docs/guides/lora.md).

    Args:
        path (`str`): the folder or file.

    Raises:
        ValueError: at `setup`, if the path is missing, is not a LoRA, or the LoRA does not fit the policy (other
            modules, rank or alpha; the message names ``reference.path``).
    """

    strategy = "checkpoint"

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.validation`): ``reference.path`` is given and
        holds LoRA weights.

        Raises:
            ValueError: when it is unset or not a LoRA; FileNotFoundError: when it does not exist or a folder holds no
                ``pytorch_lora_weights.safetensors``.
        """
        from omegaconf import OmegaConf

        from diffalign.lora_io import read_lora

        if OmegaConf.is_missing(cfg.reference, "path"):
            raise ValueError("reference.path is required for reference=checkpoint; pass reference.path=<LoRA folder or "
                             ".safetensors file>")
        read_lora(cfg.reference.path, field_name="reference.path")

    def __init__(self, path: str):
        self.path = str(path)
        self.version = 0
        self.samples = SampleCache()
        self.adapter: ReferenceAdapter | None = None

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Adds the reference adapter and loads the LoRA into it (float32).

        Raises:
            ValueError: naming ``reference.path``: see the class docstring.
        """
        from diffalign.lora_io import read_lora

        _require_lora(policy, self.strategy)
        source = f"reference.path={self.path!r}"
        try:
            weights = read_lora(self.path, field_name="reference.path",
                                unet_config=getattr(policy.denoiser, "config", None))
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
        config = policy.denoiser.peft_config[POLICY_ADAPTER]
        if int(config.r) != weights.rank or float(config.lora_alpha) != weights.alpha:
            raise ValueError(f"{source} has r={weights.rank}, alpha={weights.settings['lora_alpha']} but the policy's "
                             f"adapter r={config.r}, alpha={config.lora_alpha}; use a LoRA of the run's "
                             "model.lora_rank and model.lora_alpha (the reference adapter copies the policy's)")
        self.adapter = ReferenceAdapter(policy)
        self.adapter.load({k: v.float() for k, v in weights.state.items()}, source)

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        """Runs the block with the checkpoint's adapter active and the UNet in eval mode."""
        with self.adapter.activate():
            yield policy

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Nothing to do; returns False."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The path and the loaded tensors (so a resumed run does not depend on the folder still existing)."""
        return {"strategy": self.strategy, "path": self.path, "version": self.version,
                "weights": {k: p.detach() for k, p in self.adapter.params.items()},
                "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_strategy(state, self.strategy)
        self.adapter.load(state["weights"], "the checkpoint's reference state")
        self.samples.load_state_dict(state["samples"])


@config_schema("reference", "ema")
@dataclass
class EmaReferenceConfig:
    """Config of `EmaReference`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.reference.EmaReference"
    decay: float = 0.999
    update_every: int = 1


class EmaReference:
    r"""An exponential moving average of the policy's LoRA as the reference:
    $\theta_r \leftarrow \text{decay}\cdot\theta_r + (1-\text{decay})\cdot\theta$ every `update_every` updates, starting
    from the policy's initial adapter (an EMA reference as DGPO's θ⁻, arXiv:2510.08425;
    docs/methods/algorithms.md#dgpo-rollout-policy).

    Args:
        decay (`float`, defaults to 0.999): in [0, 1); 0 makes the reference the policy as of the last update.
        update_every (`int`, defaults to 1): EMA period in optimizer updates, ≥ 1.

    Raises:
        ValueError: if `decay` is outside [0, 1) or `update_every` < 1 (naming ``reference.decay`` /
            ``reference.update_every``).
    """

    strategy = "ema"

    def __init__(self, decay: float = 0.999, update_every: int = 1):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"reference.decay={decay} must be in [0, 1), e.g. 0.999.")
        if update_every < 1:
            raise ValueError(f"reference.update_every={update_every} must be >= 1.")
        self.decay, self.update_every = decay, update_every
        self.version = 0
        self.last_step: int | None = None
        self.samples = SampleCache()
        self.adapter: ReferenceAdapter | None = None

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Adds the reference adapter and copies the policy's current (initial) adapter into it."""
        _require_lora(policy, self.strategy)
        self.adapter = ReferenceAdapter(policy)
        self.adapter.load(self.adapter.snapshot_policy(), "the policy's initial adapter")

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        with self.adapter.activate():
            yield policy

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Before update `global_step` (0-based; the policy has had `global_step` updates): an EMA step when
        ``global_step > 0`` and ``global_step % update_every == 0``. Returns True when θ_r changed. Calling it twice
        for one step does nothing the second time."""
        if global_step == self.last_step:
            return False
        self.last_step = global_step
        if global_step == 0 or global_step % self.update_every != 0:
            return False
        self.adapter.lerp_towards_policy(1.0 - self.decay)
        self.version += 1
        self.samples.clear()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "decay": self.decay, "update_every": self.update_every,
                "version": self.version, "last_step": self.last_step,
                "weights": {k: p.detach() for k, p in self.adapter.params.items()},
                "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_strategy(state, self.strategy)
        self.adapter.load(state["weights"], "the checkpoint's EMA reference")
        self.version, self.last_step = state["version"], state["last_step"]
        self.samples.load_state_dict(state["samples"])


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

    _target_: str = "diffalign.reference.PoolReference"
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
        _require_lora(policy, self.strategy)
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
        _check_strategy(state, self.strategy)
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
