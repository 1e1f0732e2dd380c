"""Fully sharded data parallel (FSDP) training for both loops: what a run needs beyond accelerate's ``prepare``.

Launch (docs/guides/reliability.md#distributed): ``accelerate launch --config_file configs/accelerate/fsdp.yaml
--num_processes N train.py ...``; on CPU (gloo) add ``trainer.cpu=true``. FSDP1 ``FULL_SHARD`` with
``use_orig_params=True`` (only the LoRA trains, so the optimizer sees the original parameters), the denoiser as one
FSDP unit (``fsdp_auto_wrap_policy: NO_WRAP``; `fsdp_root` refuses several).

What this module adds to accelerate 1.15 / torch 2.14:

- `fsdp_plugin_for` / `switch_fsdp_on` / `wrap_on_cpu`: with ``cpu=True`` accelerate sets up a ``MULTI_CPU`` (gloo)
  state and drops the FSDP plugin without a word (``AcceleratorState`` turns FSDP on only for GPU-like device
  types); its plugin refuses ``sync_module_states`` without a GPU-like device, and FSDP1 refuses the ``device_id``
  accelerate passes on CPU. The plugin is built with ``sync_module_states`` off, the state switched to FSDP (with a
  log line), and the denoiser wrapped here with ``device_id=cpu`` after rank 0's weights are broadcast.
- `clip_grad_norm`: ``Accelerator.clip_grad_norm_`` uses FSDP's norm only when it is given *all* the model's
  parameters; the loops pass the trainable ones, so it would clip each shard by its own local norm. Here the FSDP
  root's ``clip_grad_norm_`` is called: the norm over all shards.
- `full_weights` / `main_process_work`: every process holds the full (unsharded) weights inside
  (``FSDP.summon_full_params``, a collective: every process must enter): LoRA saving and loading, the
  data-preparation context, main-process-only sampling (evaluation, monitors).
- `CheckpointOptimizer`: the optimizer as a checkpoint sees it: ``state_dict()`` gathers FSDP's sharded state into
  the one-process layout (parameter ids in the optimizer's order), ``load_state_dict`` re-shards it, so a
  one-process run resumes an FSDP checkpoint (and an FSDP run a one-process one). The gather uses
  ``offload_to_cpu=False``: with torch 2.14 on CPU, ``FSDP.optim_state_dict`` with ``offload_to_cpu=True`` returns
  ``exp_avg`` equal to ``exp_avg_sq`` (scripts/fsdp_offload_gather_check.py).
- `check_launch` / `check_fsdp_run`: what is refused (DeepSpeed; under FSDP, state that snapshots the sharded LoRA).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

FSDP_STRATEGIES = ("frozen_base",)
"""Reference strategies an FSDP run supports (the others snapshot the sharded LoRA; not implemented)."""


def fsdp_requested() -> bool:
    """Whether the launcher asked for FSDP (``accelerate launch`` with an FSDP config sets ``ACCELERATE_USE_FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_plugin_for(cpu: bool) -> FullyShardedDataParallelPlugin | None:
    """The FSDP plugin for a CPU run launched with an FSDP config (None otherwise: accelerate builds its own).

    Raises:
        ValueError: for an FSDP2 config (``fsdp_version: 2``), which these loops do not run.
    """
    if not (cpu and fsdp_requested()):
        return None
    # accelerate refuses sync_module_states without a GPU-like device (and cpu_ram_efficient_loading forces it on;
    # that loading is for Transformers models only): both off at construction, sync_module_states back on after
    plugin = FullyShardedDataParallelPlugin(sync_module_states=False, cpu_ram_efficient_loading=False)
    if plugin.fsdp_version != 1:
        raise ValueError(f"fsdp_version={plugin.fsdp_version} in the accelerate config; diffalign's loops run FSDP1 "
                         "(fsdp_version: 1, as in configs/accelerate/fsdp.yaml)")
    plugin.sync_module_states = os.environ.get("FSDP_SYNC_MODULE_STATES", "true").lower() == "true"
    return plugin


def switch_fsdp_on(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None, log=print) -> None:
    """Turns FSDP back on for a CPU launch that asked for it (`fsdp_plugin_for`), with a log line; a no-op otherwise."""
    if plugin is None or accelerator.distributed_type == DistributedType.FSDP:
        return
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return  # one process: nothing to shard
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    # as AcceleratorState.__init__ does: every later AcceleratorState() copies PartialState's shared state over its own
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    log(f"[diffalign] FSDP on CPU: accelerate {_accelerate_version()} turns FSDP off with trainer.cpu=true; switched "
        f"back on ({plugin.sharding_strategy.name}, use_orig_params={plugin.use_orig_params}, gloo, "
        f"{accelerator.num_processes} processes)")


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def is_fsdp(accelerator: Accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def check_fsdp_run(accelerator: Accelerator, reference, objective) -> None:
    """Refuses what an FSDP run does not support, before the model is wrapped.

    Raises:
        ValueError: ``use_orig_params`` off, a reference strategy that snapshots the LoRA (ema, pool, checkpoint), or
            a method that keeps its own copies of the weights (``checkpoint_states``, e.g. DGPO's, DiffusionNFT's
            old policy, SePPO's reference); each names the setting and the fix.
    """
    if not is_fsdp(accelerator):
        return
    if not accelerator.state.fsdp_plugin.use_orig_params:
        raise ValueError("fsdp_use_orig_params: false in the accelerate config; set it to true (only the LoRA trains; "
                         "configs/accelerate/fsdp.yaml)")
    if reference.strategy not in FSDP_STRATEGIES:
        raise ValueError(f"reference={reference.strategy} under FSDP: it snapshots the sharded LoRA, which is not "
                         f"implemented; use reference={FSDP_STRATEGIES[0]} or launch with configs/accelerate/ddp.yaml")
    if objective.checkpoint_states():
        raise ValueError(f"{type(objective).__name__} under FSDP: it keeps its own copies of the weights "
                         f"({', '.join(objective.checkpoint_states())}), which are not sharded yet; launch it with "
                         "configs/accelerate/ddp.yaml")


def fsdp_root(accelerator: Accelerator):
    """The FSDP-wrapped model of `accelerator` (there is one: the denoiser)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    roots = [m for m in accelerator._models if isinstance(m, FSDP)]
    if len(roots) != 1:
        raise RuntimeError(f"expected one FSDP-wrapped model in the accelerator, found {len(roots)}")
    units = len(FSDP.fsdp_modules(roots[0]))
    if units != 1:  # inside summon_full_params nested units return no state dict (peft saw 0 LoRA keys)
        raise ValueError(f"the FSDP auto-wrap policy split the denoiser into {units} units; diffalign gathers it as one "
                         "(LoRA checkpoints, main-process sampling): set fsdp_auto_wrap_policy: NO_WRAP in the "
                         "accelerate config (configs/accelerate/fsdp.yaml)")
    return roots[0]


def clip_grad_norm(accelerator: Accelerator, params, max_norm: float) -> torch.Tensor | None:
    """``accelerator.clip_grad_norm_(params, max_norm)``; under FSDP the root module's ``clip_grad_norm_`` (the total
    norm over every shard, the same on every process)."""
    if is_fsdp(accelerator):
        accelerator.unscale_gradients()
        return fsdp_root(accelerator).clip_grad_norm_(max_norm)
    return accelerator.clip_grad_norm_(params, max_norm)


@contextlib.contextmanager
def full_weights(policy, writeback: bool = False) -> Iterator[None]:
    """Every process holds the full weights of the policy's FSDP-wrapped denoiser inside the block (a collective:
    all processes must enter); with `writeback` changes made inside are written back to the shards. A no-op for a
    policy not under FSDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    module = getattr(policy, "forward_module", None)
    if not isinstance(module, FSDP):
        yield
        return
    with FSDP.summon_full_params(module, writeback=writeback, rank0_only=False, offload_to_cpu=False):
        yield


class CheckpointOptimizer:
    """The optimizer as `diffalign.runtime.checkpoint.save_checkpoint` / ``load_checkpoint`` see it under FSDP: the
    state in the one-process layout (`state_dict`, a collective), re-sharded on load.

    Args:
        optimizer: the prepared optimizer (accelerate's wrapper or a torch optimizer) over the original parameters.
        module: the FSDP root.
    """

    def __init__(self, optimizer, module):
        self.optimizer, self.module = optimizer, module

    def _torch_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _names(self) -> list[str]:
        """The clean FQN of every optimizer parameter, in the optimizer's order (= the one-process ids)."""
        from torch.distributed.fsdp._common_utils import clean_tensor_name

        by_id = {id(p): clean_tensor_name(n) for n, p in self.module.named_parameters()}
        return [by_id[id(p)] for g in self._torch_optimizer().param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        optim = self._torch_optimizer()
        # offload_to_cpu=False: with it, torch 2.14 on CPU gathered exp_avg_sq as a copy of exp_avg
        with FSDP.state_dict_type(self.module, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            full = FSDP.optim_state_dict(self.module, optim)
        index = {name: i for i, name in enumerate(self._names())}
        groups = []
        for group in full["param_groups"]:
            groups.append({**group, "params": [index[n] for n in group["params"]]})
        return {"state": {index[n]: s for n, s in full["state"].items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        names = self._names()
        by_name = {"state": {names[int(i)]: s for i, s in state_dict["state"].items()},
                   "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                                    for g in state_dict["param_groups"]]}
        optim = self._torch_optimizer()
        with FSDP.state_dict_type(self.module, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            sharded = FSDP.optim_state_dict_to_load(self.module, optim, by_name)
        optim.load_state_dict(sharded)


@contextlib.contextmanager
def main_process_work(accelerator: Accelerator, policy, due: bool = True) -> Iterator[bool]:
    """Yields whether this process does the main-process-only work with `policy` (evaluation, monitors). Under FSDP,
    when the work is `due`, every process enters `full_weights` (a collective), so the main process samples with the
    full weights through the bare denoiser (`diffalign.models.base.bare_forward`) while the others wait."""
    if not (due and is_fsdp(accelerator)):
        yield accelerator.is_main_process
        return
    with full_weights(policy):
        yield accelerator.is_main_process


def wrap_on_cpu(accelerator: Accelerator, module: torch.nn.Module) -> torch.nn.Module:
    """Under FSDP on CPU, `module` wrapped in FSDP with the plugin's settings and ``device_id=cpu`` (accelerate passes
    its device, ``cpu:0`` on a gloo launch, which FSDP1 refuses: "Inconsistent compute device and `device_id`: cpu vs
    cpu:0");
    ``accelerator.prepare`` then keeps the wrapper. Otherwise `module` unchanged (accelerate wraps it)."""
    if not (is_fsdp(accelerator) and accelerator.device.type == "cpu"):
        return module
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(module)
    if plugin.sync_module_states:  # FSDP1 syncs only GPU modules: rank 0's weights broadcast here instead (gloo)
        for tensor in module.state_dict(keep_vars=True).values():
            torch.distributed.broadcast(tensor.data, src=0)
    return FSDP(module, sharding_strategy=plugin.sharding_strategy, cpu_offload=plugin.cpu_offload,
                auto_wrap_policy=plugin.auto_wrap_policy, mixed_precision=plugin.mixed_precision_policy,
                sync_module_states=False, backward_prefetch=plugin.backward_prefetch,
                forward_prefetch=plugin.forward_prefetch, use_orig_params=plugin.use_orig_params,
                limit_all_gathers=plugin.limit_all_gathers, device_id=torch.device("cpu"))


DEEPSPEED_REFUSED = (
    "a DeepSpeed launch (ACCELERATE_USE_DEEPSPEED=true, e.g. accelerate launch --config_file "
    "configs/accelerate/deepspeed_zero2.yaml) does not run diffalign's loops: (1) accelerate's DeepSpeed preparation "
    "needs a DataLoader or an integer train_micro_batch_size_per_gpu, and the loops pass neither (they draw their own "
    "batches); (2) DeepSpeed's engine takes the optimizer step inside backward() at its own accumulation boundary, "
    "while the loops own their updates (no_sync micro-batches, the non-finite guard that skips an update, clipping by "
    "trainer.max_grad_norm); (3) with trainer.cpu=true accelerate drops DeepSpeed without a word and would run plain "
    "data parallel. Launch with configs/accelerate/fsdp.yaml (sharded) or configs/accelerate/ddp.yaml instead "
    "(docs/guides/reliability.md#distributed)")


def check_launch(cfg=None, env=None) -> None:
    """Refuses a launch the loops cannot run, before any model loads (`diffalign.cli`, after the config's validation).

    Args:
        cfg (`DictConfig`, *optional*): the run's config; under an FSDP launch its reference strategy and method are
            checked (`check_fsdp_run` repeats this on the built objects).
        env (`Mapping`, *optional*): the environment (defaults to ``os.environ``).

    Raises:
        ValueError: for a DeepSpeed launch, with its causes (`DEEPSPEED_REFUSED`) and the fix; under FSDP, on a machine
            without a GPU unless ``trainer.cpu`` is true, for a reference strategy that snapshots the LoRA or a method that keeps its own copies of the weights.
    """
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ValueError(DEEPSPEED_REFUSED)
    if cfg is None or env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    import torch

    if not torch.cuda.is_available() and not cfg.trainer.get("cpu", False):
        raise ValueError("an FSDP launch on a machine without a GPU: pass trainer.cpu=true to shard over CPU processes "
                         "(gloo), or launch on GPUs (accelerate would otherwise stop with its own traceback)")
    from hydra.utils import get_class, instantiate

    strategy = getattr(get_class(cfg.reference._target_), "strategy", None)
    if strategy not in FSDP_STRATEGIES:
        raise ValueError(f"reference={strategy} under FSDP: it snapshots the sharded LoRA, which is not implemented; "
                         f"use reference={FSDP_STRATEGIES[0]} or launch with configs/accelerate/ddp.yaml")
    kept = instantiate(cfg.method).checkpoint_states()  # (methods' constructors only check and store arguments)
    if kept:
        name = cfg.method._target_.rsplit(".", 1)[-1]
        raise ValueError(f"method={_method_name(cfg)} under FSDP: {name} keeps its own copies of the weights "
                         f"({', '.join(kept)}), which are not sharded yet; launch it with configs/accelerate/ddp.yaml")


def _method_name(cfg) -> str:
    """The ``method=`` option chosen on the command line (Hydra's choice), else the class name."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices["method"]
    except (ValueError, KeyError):
        return cfg.method._target_.rsplit(".", 1)[-1].lower()
