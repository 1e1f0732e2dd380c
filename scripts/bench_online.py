"""Benchmark of the online loops (DGPO, Flow-GRPO on SD3 and FLUX, DDPO, ViPO, DiffusionNFT), phase by phase, against
the denoiser's floor — the online counterpart of ``scripts/bench_main_job.py``.

For each tiny online recipe it runs epochs of `diffalign.train.online` (its own ``_setup`` and ``_epoch``, unchanged)
and times, from outside, the four phases of an epoch: **rollout** (``group_rollout``), **reward** (the rewards'
scoring, ``ChunkScorer.result``), **advantages** (``_advantages``) and **update** (``method.prepare`` + the optimizer
updates, ``_updates``). Timers are wrappers put around those names in this process only, and a forward pre-hook on
the denoiser records every call it gets (its tensors' shapes and whether gradients are on); the loop's code is not
touched, and nothing runs when this script does not.

Each phase that calls the denoiser is printed beside its **floor**, measured in the same process right after each
measured epoch: the bare denoiser alone replaying every call the phase made, with the very inputs of the first call
of each shape (no sampler, VAE, text encoder, reward or loop around it). A call without gradients is replayed as a
bare forward (LoRA adapters disabled, as ``bench_main_job.py``'s floors; diffalign's policy-gradient rollouts keep a
trained adapter unfused so their log-probs are exact, so a ratio above 1 there includes the LoRA branch); a call with
gradients as a plain forward + backward of the adapted denoiser (its LoRA trained, the loss the output's mean
square). The replay runs on a copy of the denoiser (`copy.deepcopy`) under `torch.random.fork_rng`, so the run's
model, adapters and random streams are as without it.

The rollout's floor is that of issue 33 (the denoiser forwards the rollout needs, bare). A stochastic rollout runs a
trained adapter unfused so that its stored log-probs equal the update's recompute, so its ratio includes the LoRA
branch's extra matmuls; the ODE rollouts (DGPO, DiffusionNFT) fold it into the weights (``online.fuse_rollout_lora``
"auto", the default; an all-zero adapter, before the first update, is skipped by every rollout). A third floor,
**adapted**, replays the same forwards with the LoRA branch on (the floor of a rollout that must run it unfused),
printed with the branch's share of the FLOPs: counted (`torch.utils.flop_counter.FlopCounterMode`, adapted vs bare
forward) and r·(d_in + d_out) / (d_in·d_out) over the adapted linear layers. The rollout also encodes its prompts and decodes the final latents for the reward, which that floor
leaves out, so a second floor is printed beside it (**rollout, with text + VAE**): the bare denoiser's replays plus
the policy's own `encode_prompts` and `decode` replaying every call the rollout made to them, again with the inputs
of the first call of each shape, timed in the same process right after the epoch.

    python scripts/bench_online.py                              # every tiny online recipe, 1 warm-up + 2 epochs
    python scripts/bench_online.py --recipes tiny_flow_grpo tiny_ddpo --epochs 3
    python scripts/bench_online.py --quick                      # small epochs (2 groups x 4, 4 steps): a smoke test
    python scripts/bench_online.py --compare e5cbf18 --repeats 3   # the same at commit e5cbf18, alternating (ABAB)
    python scripts/bench_online.py --json out.json -- online.group_size=16   # extra Hydra overrides after --
    OMP_NUM_THREADS=1 python scripts/bench_online.py --clock process        # CPU seconds, for a loaded machine

``--clock process`` reads every phase and replay with the measuring process's CPU time (`time.process_time`): with
one thread a phase's CPU seconds are its work whatever else the machine runs (they leave out waiting, e.g. a reward
server; with several threads they add up every thread's spinning). The wall clock (default) is for a quiet machine.

Every (recipe, checkout) measurement runs in a subprocess of its own (``--child``); with ``--compare REV`` the
commit's package is checked out into a temporary worktree and the same measurement (this script's hooks) runs
against it, alternating with this checkout, and the epoch times' ratio is printed per recipe. A commit whose loop
lacks the hooked names (``_setup``, ``_epoch``, ``group_rollout``, ``ChunkScorer``, ``_advantages``, ``_updates``)
is refused with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = dict(os.environ)

RECIPES = ["tiny_flow_grpo", "tiny_ddpo", "tiny_dgpo", "tiny_vipo_image", "tiny_diffusion_nft", "tiny_vipo_wan",
           "tiny_flow_grpo_flux"]
PHASES = ("rollout", "reward", "advantages", "update")
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_now = time.perf_counter  # every phase and replay is read with this clock (`--clock`)
HOOKED = ("_setup", "_epoch", "group_rollout", "ChunkScorer", "_advantages", "_updates")
# every measurement: no evaluation, trackers, checkpoints or monitors (not part of an epoch)
COMMON = ["eval.enabled=false", "trainer.log_with=none", "online.checkpointing_epochs=null", "monitor.every=0",
          "online.num_epochs=1000"]
# --quick: small epochs, for a smoke test of the tool (the figures mean little at this size)
QUICK = ["online.groups_per_epoch=2", "online.group_size=4", "online.rollout_batch_size=8", "trainer.batch_size=8",
         "sampler.num_inference_steps=4"]
QUICK_PER_RECIPE = {
    "tiny_ddpo": ["online.tracker_min_count=2"],
    "tiny_dgpo": ["method.timestep_max_index=2", "method.timesteps_per_epoch=2"],
}


def recipe_overrides(recipe: str, quick: bool, extra: list[str]) -> list[str]:
    """The Hydra overrides of one measurement: the recipe, `COMMON`, `QUICK` (with `quick`), then `extra`."""
    out = [f"recipe={recipe}", *COMMON]
    if quick:
        out += QUICK + QUICK_PER_RECIPE.get(recipe, [])
    return out + list(extra)


# ----------------------------------------------------------------------------------------------- recording calls


def _tensors(obj):
    """The tensors in a (nested) call argument, in order."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _detached(obj):
    """A copy of a call argument with every tensor detached and cloned (the replay must not hold the run's graph)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _first_tensor(out):
    """The first output tensor of a denoiser (a diffusers output object, a tuple or a tensor)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    if hasattr(out, "sample"):
        return out.sample
    return next(iter(out.values()))


class Recorder:
    """Phase clocks and denoiser calls of the current epoch.

    ``calls[phase][signature]`` counts the denoiser calls of one phase by signature (the shapes of the call's tensors
    and whether gradients were on); ``inputs[signature]`` keeps the inputs of the first call of each signature, for
    the floor's replay."""

    def __init__(self):
        self.phase = "other"
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, dict[str, int]] = {}
        self.inputs: dict[str, tuple[tuple, dict, bool]] = {}
        self.side_calls: dict[str, int] = {}  # the rollout's encode_prompts / decode calls (`record_rollout_calls`)
        self.side_inputs: dict[str, tuple[str, tuple, dict]] = {}
        self.paused = False

    def reset(self) -> None:
        self.seconds, self.calls, self.side_calls = {}, {}, {}

    @contextlib.contextmanager
    def timing(self, phase: str):
        outer, self.phase = self.phase, phase
        start = _now()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + _now() - start
            self.phase = outer

    def pre_hook(self, module, args, kwargs):
        """The denoiser's forward pre-hook: counts the call under the current phase (returns None: inputs unchanged)."""
        if self.paused:
            return
        import torch

        grad = torch.is_grad_enabled()
        shapes = [tuple(t.shape) for t in _tensors((args, kwargs)) if t.ndim > 0]
        signature = f"{'fwd+bwd' if grad else 'fwd'} {shapes}"
        phase = self.calls.setdefault(self.phase, {})
        phase[signature] = phase.get(signature, 0) + 1
        if signature not in self.inputs:
            self.inputs[signature] = (_detached(args), _detached(kwargs), grad)


def record_rollout_calls(policy, recorder: Recorder, names=("encode_prompts", "decode")) -> dict:
    """Wraps the policy's `names` (instance attributes: this run only) so that each call made during the rollout phase
    is counted in ``recorder.side_calls[signature]`` (the name and the call's prompt count or tensor shapes) and the
    first call's inputs of each signature are kept in ``recorder.side_inputs``; returns the originals."""
    originals = {name: getattr(policy, name) for name in names}

    def wrap(name, original):
        def recorded(*args, **kwargs):
            if recorder.phase == "rollout" and not recorder.paused:
                shapes = [len(a) if isinstance(a, (list, tuple)) else tuple(a.shape) if hasattr(a, "shape") else a
                          for a in args]
                signature = f"{name} {shapes} {sorted(kwargs.items())}"
                recorder.side_calls[signature] = recorder.side_calls.get(signature, 0) + 1
                if signature not in recorder.side_inputs:
                    recorder.side_inputs[signature] = (name, _detached(args), _detached(kwargs))
            return original(*args, **kwargs)
        return recorded

    for name, original in originals.items():
        setattr(policy, name, wrap(name, original))
    return originals


def side_replay_seconds(originals: dict, recorder: Recorder, repeats: int, sync) -> dict[str, float]:
    """Median seconds of one call of each recorded `encode_prompts` / `decode` signature (`record_rollout_calls`),
    replayed with the policy's own methods on the recorded inputs without gradients (random streams left as they
    were)."""
    import torch

    out = {}
    recorder.paused = True
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for signature, (name, args, kwargs) in sorted(recorder.side_inputs.items()):
                if signature not in recorder.side_calls:
                    continue

                def call(name=name, args=args, kwargs=kwargs):  # bound now (called only in this iteration)
                    originals[name](*args, **kwargs)
                    sync()

                out[signature] = _median_seconds(call, repeats)
    finally:
        recorder.paused = False
    return out


def _median_seconds(call, repeats: int) -> float:
    """Median seconds (`_now`'s clock) of `repeats` calls of `call`, after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        start = _now()
        call()
        times.append(_now() - start)
    return statistics.median(times)


def _replay(bare, args: tuple, kwargs: dict, grad: bool, sync, adapted: bool = False):
    """A function running one recorded call on `bare`: with gradients a forward + backward of the adapted model (loss:
    the output's mean square), without a forward with the adapters switched off (`adapted`: on, the LoRA branch
    unfused, as a rollout that stores exact log-probs runs it)."""
    import torch

    if grad:
        def call():
            _first_tensor(bare(*args, **kwargs)).float().square().mean().backward()
            sync()
    elif adapted:
        def call():
            with torch.no_grad():
                bare(*args, **kwargs)
            sync()
    else:
        def call():
            with torch.no_grad():
                bare.disable_adapters()
                try:
                    bare(*args, **kwargs)
                finally:
                    bare.enable_adapters()
            sync()
    return call


def replay_seconds(denoiser, recorder: Recorder, signatures: set[str], repeats: int, sync,
                   adapted: bool = False) -> dict[str, float]:
    """Median seconds of one bare call of each signature (`Recorder`), replayed on a copy of `denoiser` with the
    recorded inputs (`_replay`; the copy's trainable parameters are the run's; `adapted`: the calls without gradients
    with the adapters on). The run's model and random streams are left as they were."""
    import torch

    recorder.paused = True
    out = {}
    try:
        with torch.random.fork_rng(devices=[]):
            bare = copy.deepcopy(denoiser)
            bare._forward_pre_hooks.clear()
            for p in bare.parameters():
                p.grad = None
            for signature in sorted(signatures):
                args, kwargs, grad = recorder.inputs[signature]
                bare.train(grad)
                out[signature] = _median_seconds(_replay(bare, args, kwargs, grad, sync, adapted), repeats)
    finally:
        recorder.paused = False
    return out


def lora_flops(denoiser, recorder: Recorder, signature: str) -> dict[str, float]:
    """The LoRA branch's cost in FLOPs, two ways, for one recorded call without gradients: ``counted`` the adapted
    forward's FLOPs over the bare one's − 1 (`torch.utils.flop_counter.FlopCounterMode`, on a copy of `denoiser`), and
    ``formula`` Σ r·(d_in + d_out) / Σ d_in·d_out over the adapted linear layers (the branch's extra matmul work per
    row relative to those layers' own, an upper bound of the counted share: the unadapted layers and attention's
    score matmuls dilute it)."""
    import torch
    from peft.tuners.lora import LoraLayer
    from torch.utils.flop_counter import FlopCounterMode

    args, kwargs, _ = recorder.inputs[signature]
    recorder.paused = True
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            bare = copy.deepcopy(denoiser)
            bare._forward_pre_hooks.clear()
            counts = {}
            for adapted in (False, True):
                if not adapted:
                    bare.disable_adapters()
                with FlopCounterMode(display=False) as counter:
                    bare(*args, **kwargs)
                counts[adapted] = counter.get_total_flops()
                bare.enable_adapters()
    finally:
        recorder.paused = False
    extra = base = 0
    for layer in denoiser.modules():
        if isinstance(layer, LoraLayer) and isinstance(layer.get_base_layer(), torch.nn.Linear):
            d_in, d_out = layer.in_features, layer.out_features
            for name in layer.active_adapters:
                if name in layer.lora_A:
                    extra += layer.r[name] * (d_in + d_out)
                    base += d_in * d_out
    return {"counted": counts[True] / counts[False] - 1 if counts[False] else 0.0,
            "formula": extra / base if base else 0.0}


def _has_adapters(denoiser) -> bool:
    return hasattr(denoiser, "disable_adapters") and getattr(denoiser, "peft_config", None)


# ----------------------------------------------------------------------------------------------- one measurement


# The package's layout moved modules (diffalign.cli's config helpers to diffalign.config.compose, console and
# deprecation to runtime/ and config/); these look a name up in the new place and then the old one, so the benchmark
# runs on both (--compare REV measures older commits with this script).


def _first_import(*candidates: tuple[str, str]):
    """The first of (module, name) that imports."""
    import importlib

    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {candidates} is in this diffalign")


def asset_path(name: str):
    """The shipped tiny model folder `name` (``diffalign/assets``)."""
    return _first_import(("diffalign.config.compose", "asset_path"), ("diffalign.cli", "asset_path"))(name)


def migrate_config(cfg) -> None:
    """What the loop's `train` does first: old config keys moved to their new names (before the deprecation layer was
    removed), else keys no structured node has refused."""
    _first_import(("diffalign.config.deprecation", "migrate_config"), ("diffalign.deprecation", "migrate_config"),
                  ("diffalign.config.checks", "check_structured_keys"))(cfg)


def setup_run(loop, cfg):
    """The loop's `_setup` on `cfg`: through `diffalign.train.prepare.prepare_run` (checked and built once) where this
    diffalign has it, else on the config after `migrate_config` (older revisions, for ``--compare``)."""
    try:
        from diffalign.train.prepare import prepare_run
    except ImportError:
        migrate_config(cfg)
        return loop._setup(cfg)
    return loop._setup(prepare_run(cfg))


def warning_counts():
    """A fresh `WarningCounts` (what the loop's `train` hands every run)."""
    return _first_import(("diffalign.runtime.console", "WarningCounts"), ("diffalign.console", "WarningCounts"))()


def compose_config(overrides: list[str]):
    """The ``train`` config of `overrides` (Hydra compose, as the CLI)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = _first_import(("diffalign.config.compose", "CONFIG_DIR"), ("diffalign.cli", "CONFIG_DIR"))
    _first_import(("diffalign.config.compose", "setup_hydra"), ("diffalign.cli", "_setup"))()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def instrument(loop, recorder: Recorder) -> dict:
    """Puts the phase clocks around the loop's names (this process only; the code is unchanged); returns the
    originals, for `restore`."""
    missing = [name for name in HOOKED if not hasattr(loop, name)]
    if missing:
        raise SystemExit(f"bench_online: diffalign.train.online at {Path(loop.__file__).parent.parent.parent} has no "
                         f"{', '.join(missing)}; this benchmark times those names (use a commit whose online loop "
                         "has them)")
    originals = {name: getattr(loop, name) for name in HOOKED}
    rollout, advantages, updates, scorer_class = loop.group_rollout, loop._advantages, loop._updates, loop.ChunkScorer

    def timed_rollout(*args, **kwargs):
        with recorder.timing("rollout"):
            return rollout(*args, **kwargs)

    class TimedScorer(scorer_class):
        def result(self, *args, **kwargs):
            with recorder.timing("reward"):
                return super().result(*args, **kwargs)

    def timed_advantages(*args, **kwargs):
        with recorder.timing("advantages"):
            return advantages(*args, **kwargs)

    def timed_updates(*args, **kwargs):
        with recorder.timing("update"):
            return updates(*args, **kwargs)

    loop.group_rollout, loop._advantages, loop._updates, loop.ChunkScorer = (timed_rollout, timed_advantages,
                                                                            timed_updates, TimedScorer)
    return originals


def lora_digest(policy) -> str:
    """SHA-256 of the trainable parameters' values, in name order (to check that measuring changed nothing)."""
    import hashlib

    digest = hashlib.sha256()
    for name, p in sorted(policy.denoiser.named_parameters()):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()

def measure(recipe: str, overrides: list[str], *, warmup: int, epochs: int, floor_repeats: int,
            device: str | None = None, after_setup=None) -> dict:
    """Runs `warmup` + `epochs` epochs of `recipe` (with `overrides`) in this process; returns, per measured epoch,
    the phases' seconds and floors (`replay_seconds` × the phase's calls), and the calls per phase. `after_setup(run)`,
    if given, is called once on the set-up run before the first epoch (e.g. ``scripts/cost_model.py`` sets the
    denoiser's default resolution there)."""
    import torch

    from diffalign.train import online as loop

    out_dir = Path(tempfile.mkdtemp(prefix=f"bench-online-{recipe}-"))
    cfg = compose_config([*overrides, f"output_dir={out_dir}"] + ([f"trainer.cpu={device == 'cpu'}"] if device
                                                                  else []))
    recorder = Recorder()
    originals = instrument(loop, recorder)
    run = setup_run(loop, cfg)
    run.warnings = warning_counts()
    prepare = run.objective.prepare

    def timed_prepare(*args, **kwargs):
        with recorder.timing("update"):
            return prepare(*args, **kwargs)

    run.objective.prepare = timed_prepare  # (an instance attribute: this run only)
    if after_setup is not None:
        after_setup(run)
    denoiser = run.policy.denoiser
    if not _has_adapters(denoiser):
        raise SystemExit(f"bench_online: {recipe}'s denoiser has no LoRA adapters to switch off for the floor")
    handle = denoiser.register_forward_pre_hook(recorder.pre_hook, with_kwargs=True)
    side_originals = record_rollout_calls(run.policy, recorder)
    dev = str(run.policy.device)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    result = {"recipe": recipe, "overrides": overrides, "epochs": [], "device": dev,
              "threads": torch.get_num_threads(),
              "work": {"groups_per_epoch": cfg.online.groups_per_epoch, "group_size": cfg.online.group_size,
                       "num_inference_steps": cfg.sampler.num_inference_steps,
                       "guidance_scale": cfg.sampler.guidance_scale, "batch_size": cfg.trainer.batch_size,
                       "method": cfg.method._target_.rsplit(".", 1)[-1], "sampler": cfg.sampler.name,
                       "stochastic": bool(run.sampler.stochastic),
                       "fuse_rollout_lora": cfg.online.get("fuse_rollout_lora", False)}}
    try:
        for e in range(warmup + epochs):
            recorder.reset()
            start = _now()
            logs = loop._epoch(run)
            total = _now() - start
            run.epoch += 1
            if e < warmup:
                continue
            signatures = {s for calls in recorder.calls.values() for s in calls}
            per_call = replay_seconds(denoiser, recorder, signatures, floor_repeats, sync)
            floors = {phase: sum(n * per_call[s] for s, n in calls.items())
                      for phase, calls in recorder.calls.items()}
            rollout_calls = recorder.calls.get("rollout", {})
            adapted = replay_seconds(denoiser, recorder, set(rollout_calls), floor_repeats, sync, adapted=True)
            side = side_replay_seconds(side_originals, recorder, floor_repeats, sync)
            side_floor = sum(n * side[s] for s, n in recorder.side_calls.items())
            if rollout_calls and "lora_flops" not in result:
                result["lora_flops"] = lora_flops(denoiser, recorder, max(rollout_calls, key=rollout_calls.get))
            result["epochs"].append({"total": total, "seconds": dict(recorder.seconds), "floors": floors,
                                     "rollout_floor_with_text_vae": floors.get("rollout", 0.0) + side_floor,
                                     "rollout_floor_adapted": sum(n * adapted[s] for s, n in rollout_calls.items()),
                                     "side_calls": dict(recorder.side_calls), "side_per_call": side,
                                     "calls": {p: dict(c) for p, c in recorder.calls.items()},
                                     "per_call": per_call, "reward": float(logs.get("reward/mean", float("nan")))})
        result["lora_sha256"] = lora_digest(run.policy)
    finally:
        handle.remove()
        for name in side_originals:
            delattr(run.policy, name)  # (the instance attributes go; the class's methods show again)
        for name, value in originals.items():
            setattr(loop, name, value)
        shutil.rmtree(out_dir, ignore_errors=True)
    return result


def summarize(result: dict) -> dict:
    """Median over the measured epochs of every phase's seconds and floor, and of the epoch."""
    epochs = result["epochs"]
    med = {"total": statistics.median(e["total"] for e in epochs)}
    for phase in (*PHASES, "other"):
        med[phase] = statistics.median(e["seconds"].get(phase, 0.0) for e in epochs)
        med[f"{phase}_floor"] = statistics.median(e["floors"].get(phase, 0.0) for e in epochs)
    med["outside"] = med["total"] - sum(med[p] for p in PHASES)
    if all("rollout_floor_with_text_vae" in e for e in epochs):  # (not in the JSON of older runs of this script)
        med["rollout_floor_with_text_vae"] = statistics.median(e["rollout_floor_with_text_vae"] for e in epochs)
    if all("rollout_floor_adapted" in e for e in epochs):
        med["rollout_floor_adapted"] = statistics.median(e["rollout_floor_adapted"] for e in epochs)
    return med


def describe_calls(calls: dict[str, int]) -> str:
    """`calls` of one phase as "N × fwd [(B, C, H, W), …]" items, the first tensor's shape only."""
    parts = []
    for signature, n in sorted(calls.items(), key=lambda kv: -kv[1]):
        kind, shapes = signature.split(" ", 1)
        first = shapes[1:shapes.find(")") + 1] if "(" in shapes else shapes
        parts.append(f"{n} x {kind} {first}")
    return "; ".join(parts)


def print_result(result: dict, label: str = "") -> None:
    med = summarize(result)
    w = result["work"]
    print(f"\n{result['recipe']}{label}: {w['method']}, {w['groups_per_epoch']} prompts x {w['group_size']} samples, "
          f"{w['sampler']} {w['num_inference_steps']} steps, CFG {w['guidance_scale']}, batch {w['batch_size']}; "
          f"{result['device']}, {result['threads']} threads; median of {len(result['epochs'])} epochs")
    print(f"  {'phase':<11} {'measured':>9} {'floor':>9} {'ratio':>7}   denoiser calls (last epoch)")
    last = result["epochs"][-1]["calls"]
    for phase in PHASES:
        floor = med[f"{phase}_floor"]
        ratio = f"{med[phase] / floor:6.2f}x" if floor > 0 else "      -"
        print(f"  {phase:<11} {med[phase]:8.2f}s {floor:8.2f}s {ratio}   {describe_calls(last.get(phase, {}))}")
        if phase == "rollout" and med.get("rollout_floor_with_text_vae"):
            second = med["rollout_floor_with_text_vae"]
            print(f"  {'  +text,VAE':<11} {med[phase]:8.2f}s {second:8.2f}s {med[phase] / second:6.2f}x   the second "
                  "floor: the same forwards + the rollout's encode_prompts and VAE decode calls")
        if phase == "rollout" and med.get("rollout_floor_adapted"):
            third, flops = med["rollout_floor_adapted"], result.get("lora_flops", {})
            fused = "folded" if w.get("fuse_rollout_lora") is True or (
                w.get("fuse_rollout_lora") == "auto" and not w.get("stochastic", True)) else "unfused"
            print(f"  {'  adapted':<11} {med[phase]:8.2f}s {third:8.2f}s {med[phase] / third:6.2f}x   the third "
                  f"floor: the same forwards with the LoRA branch on (this rollout's LoRA: {fused}; LoRA FLOPs "
                  f"+{100 * flops.get('counted', 0):.1f} % counted, r(d_in+d_out)/(d_in d_out) "
                  f"{100 * flops.get('formula', 0):.1f} %)")
    if med["other"] or med["other_floor"]:
        print(f"  {'(other)':<11} {med['other']:8.2f}s {med['other_floor']:8.2f}s")
    floor = sum(med[f"{p}_floor"] for p in (*PHASES, "other"))
    print(f"  {'epoch':<11} {med['total']:8.2f}s {floor:8.2f}s {med['total'] / floor:6.2f}x   "
          f"({med['outside']:.2f} s outside the four phases)")


# ----------------------------------------------------------------------------------------------- parent


def child_command(recipe: str, args, extra: list[str]) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", recipe, "--epochs", str(args.epochs),
           "--warmup", str(args.warmup), "--floor-repeats", str(args.floor_repeats), "--clock", args.clock]
    if args.quick:
        cmd.append("--quick")
    if args.device:
        cmd += ["--device", args.device]
    return cmd + ["--", *extra]


def run_child(source: Path, cmd: list[str], metadata: Path | None = None) -> dict:
    """One measurement in a subprocess importing diffalign from `source`; its JSON result."""
    path = [str(source)] + ([str(metadata)] if metadata is not None else [])
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join(path), TQDM_DISABLE="1")
    proc = subprocess.run(cmd, env=env, cwd=source, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    raise SystemExit(f"bench_online: the measurement {' '.join(cmd[3:5])} at {source} failed: {tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per recipe (after --warmup)")
    p.add_argument("--warmup", type=int, default=1, help="epochs run first and not measured")
    p.add_argument("--floor-repeats", type=int, default=3, help="timed replays of each denoiser call signature")
    p.add_argument("--quick", action="store_true", help="small epochs (2 groups x 4 samples, 4 steps)")
    p.add_argument("--compare", metavar="REV", help="also measure commit REV, alternating with this checkout")
    p.add_argument("--repeats", type=int, default=1, help="measurements per checkout with --compare")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the loop's own choice)")
    p.add_argument("--json", type=Path, default=None, help="write every measurement here")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall seconds, or the process's CPU seconds (with OMP_NUM_THREADS=1: for a loaded machine)")
    p.add_argument("--child", metavar="RECIPE", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --) for every recipe")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.warmup < 0 or args.floor_repeats < 1 or args.repeats < 1:
        p.error("--epochs, --floor-repeats and --repeats must be >= 1, --warmup >= 0")
    if args.child:
        global _now
        _now = CLOCKS[args.clock]
        result = measure(args.child, recipe_overrides(args.child, args.quick, args.overrides), warmup=args.warmup,
                         epochs=args.epochs, floor_repeats=args.floor_repeats, device=args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    sources, metadata, tree = {"this checkout": REPO}, {}, None
    if args.compare:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_main_job import shadow_metadata, worktree

        tree = worktree(args.compare)
        sources = {args.compare: tree, "this checkout": REPO}
        metadata[args.compare] = shadow_metadata(tree)
    results: dict[str, dict[str, list[dict]]] = {}
    try:
        for recipe in args.recipes:
            for r in range(args.repeats if args.compare else 1):
                for label, source in sources.items():
                    result = run_child(source, child_command(recipe, args, args.overrides), metadata.get(label))
                    results.setdefault(recipe, {}).setdefault(label, []).append(result)
                    print_result(result, f" [{label}, run {r + 1}]" if args.compare else "")
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=1))
    finally:
        if tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    if args.compare:
        print(f"\nepoch time, this checkout / {args.compare} (median of {args.repeats} alternating runs each):")
        for recipe, by_label in results.items():
            mine = statistics.median(summarize(x)["total"] for x in by_label["this checkout"])
            theirs = statistics.median(summarize(x)["total"] for x in by_label[args.compare])
            ratios = []
            for ph in PHASES:
                a = statistics.median(summarize(x)[ph] for x in by_label["this checkout"])
                b = statistics.median(summarize(x)[ph] for x in by_label[args.compare])
                ratios.append(f"{ph} {a / b:.2f}" if b > 0 else f"{ph} -")
            phases = ", ".join(ratios)
            print(f"  {recipe:<20} {mine:7.2f} s / {theirs:7.2f} s = {mine / theirs:.2f}   ({phases})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
