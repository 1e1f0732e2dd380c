"""Where an online rollout's time goes beyond the bare denoiser: the split of issue 33 (performance round 2), item 1.

For each recipe it sets up the run (`diffalign.train.online._setup`, as ``scripts/bench_online.py``), runs one epoch
(so the LoRA has had an update and is no longer the all-zero adapter that the rollout skips), records the arguments
that epoch passed to ``group_rollout`` and then, in the same process, replays that rollout `--repeats` times with
clocks put around the names it calls (this process only; the code is unchanged):

- **denoiser**: the denoiser's forwards (a forward pre-hook and hook), with the LoRA branch as the loop runs it;
- **predict, outside the denoiser**: the policy's `predict` minus those forwards (the CFG batch ``[x, x]`` and the
  guidance combination; FLUX's packing, unpacking and position ids);
- **sampler step**: `Sampler.step` (the scheduler step, the step noise and the log-prob maths);
- **prompts**, **decode**: `encode_prompts` and the VAE's `decode`;
- **LoRA context**: `diffalign.models.base.inference_lora` around each rollout batch (finding the adapters);
- **rest**: the rollout's time minus all of the above (initial noise, generators, stacking the trajectory).

Then it replays every denoiser call of the rollout (the first call's inputs of each shape, as bench_online's floor)
three ways: **bare** (adapters disabled: bench_online's floor), **adapted** (the LoRA branch on, what the rollout
runs) and **fused** (the LoRA folded into the weights, `inference_lora(fuse=True)`), so the denoiser's share splits
into the floor and the LoRA branch's extra matmuls, and the fused forward's cost is known. Everything in one
process, one recipe after another; the median of `--repeats` rollouts and of the replays.

    python scripts/profile_rollout.py                                  # tiny_flow_grpo, tiny_diffusion_nft, FLUX
    python scripts/profile_rollout.py --recipes tiny_ddpo --repeats 5
    python scripts/profile_rollout.py --json split.json
    OMP_NUM_THREADS=1 python scripts/profile_rollout.py --clock process   # CPU seconds: for a loaded machine

``--clock process`` reads every part with this process's CPU time (`time.process_time`) instead of the wall clock:
with one thread (``OMP_NUM_THREADS=1``) a part's CPU seconds are its work, whatever else the machine runs, so the
split can be taken on a shared machine (CPU seconds leave out waiting, and with several threads count each thread's
spinning too; use the wall clock on an idle machine).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_online import COMMON, compose_config, setup_run, warning_counts

RECIPES = ["tiny_flow_grpo", "tiny_diffusion_nft", "tiny_flow_grpo_flux"]
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
_now = time.perf_counter  # the clock every part is read with (`--clock`)
PARTS = ("denoiser", "predict_outside", "step", "prompts", "decode", "lora_context", "rest")
LABELS = {"denoiser": "denoiser forwards (as run)", "predict_outside": "predict, outside the denoiser",
          "step": "sampler step (scheduler + noise + log-prob)", "prompts": "encode_prompts",
          "decode": "VAE decode", "lora_context": "inference_lora context", "rest": "rest (noise, generators, stacking)"}


class Clocks:
    """Seconds per part; nested clocks are subtracted from the outer one by the caller."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.on = False

    @contextlib.contextmanager
    def clock(self, part: str):
        if not self.on:
            yield
            return
        start = _now()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + _now() - start


def _wrap(obj, name: str, clocks: Clocks, part: str, *, generator: bool = False):
    """Replaces ``obj.name`` (an instance or module attribute) by a clocked wrapper; returns the original."""
    original = getattr(obj, name)
    if generator:  # a context manager: only its entry and exit are clocked, not the block
        @contextlib.contextmanager
        def wrapped(*args, **kwargs):
            context = original(*args, **kwargs)
            with clocks.clock(part):
                value = context.__enter__()
            try:
                yield value
            except BaseException:
                with clocks.clock(part):
                    if not context.__exit__(*sys.exc_info()):
                        raise
            else:
                with clocks.clock(part):
                    context.__exit__(None, None, None)
    else:
        def wrapped(*args, **kwargs):
            with clocks.clock(part):
                return original(*args, **kwargs)
    setattr(obj, name, wrapped)
    return original


def profile(recipe: str, repeats: int, overrides: list[str]) -> dict:
    import tempfile

    import torch

    from diffalign.models import base as model_base
    from diffalign.samplers import base as sampler_base
    from diffalign.samplers import ode as sampler_ode
    from diffalign.train import online as loop

    out_dir = tempfile.mkdtemp(prefix=f"profile-rollout-{recipe}-")
    cfg = compose_config([f"recipe={recipe}", *COMMON, f"output_dir={out_dir}", *overrides])
    run = setup_run(loop, cfg)
    run.warnings = warning_counts()
    captured = {}
    rollout = loop.group_rollout

    def capture(*args, **kwargs):
        captured.setdefault("call", (args, kwargs))
        return rollout(*args, **kwargs)

    loop.group_rollout = capture
    try:
        loop._epoch(run)  # one epoch: the LoRA gets its first update (the rollout's context is no longer "skipped")
        run.epoch += 1
    finally:
        loop.group_rollout = rollout
    args, kwargs = captured["call"]
    kwargs = dict(kwargs, on_chunk=None)
    policy, denoiser = run.policy, run.policy.denoiser
    clocks = Clocks()
    calls: dict[str, tuple] = {}
    counts: dict[str, int] = {}
    starts: list[float] = []

    def pre(module, a, kw):
        if clocks.on:
            shapes = str([tuple(t.shape) for t in list(a) + list(kw.values()) if isinstance(t, torch.Tensor)])
            counts[shapes] = counts.get(shapes, 0) + 1
            calls.setdefault(shapes, (tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a),
                                      {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                       for k, v in kw.items()}))
            starts.append(_now())

    def post(module, a, kw, out):
        if clocks.on and starts:
            clocks.seconds["denoiser"] = clocks.seconds.get("denoiser", 0.0) + _now() - starts.pop()

    handles = [denoiser.register_forward_pre_hook(pre, with_kwargs=True),
               denoiser.register_forward_hook(post, with_kwargs=True)]
    sampler = run.sampler.at_epoch(run.epoch - 1)
    step_owner = type(sampler)
    originals = {
        "predict": _wrap(policy, "predict", clocks, "predict"),
        "encode_prompts": _wrap(policy, "encode_prompts", clocks, "prompts"),
        "decode": _wrap(policy, "decode", clocks, "decode"),
    }
    step_original = step_owner.step

    def step(self, *a, **kw):
        with clocks.clock("step"):
            return step_original(self, *a, **kw)

    step_owner.step = step
    lora_base = _wrap(sampler_base, "inference_lora", clocks, "lora_context", generator=True)
    lora_ode = _wrap(sampler_ode, "inference_lora", clocks, "lora_context", generator=True)
    totals, splits = [], []
    try:
        with torch.no_grad(), run.objective.rollout_policy.use(policy):
            denoiser.eval()
            rollout(*args, **kwargs)  # warm-up
            for _ in range(repeats):
                clocks.seconds = {}
                clocks.on = True
                start = _now()
                rollout(*args, **kwargs)
                total = _now() - start
                clocks.on = False
                s = dict(clocks.seconds)
                split = {"denoiser": s.get("denoiser", 0.0),
                         "predict_outside": s.get("predict", 0.0) - s.get("denoiser", 0.0),
                         "step": s.get("step", 0.0), "prompts": s.get("prompts", 0.0), "decode": s.get("decode", 0.0),
                         "lora_context": s.get("lora_context", 0.0)}
                split["rest"] = total - sum(split.values())
                totals.append(total)
                splits.append(split)
            # the denoiser's calls replayed bare, adapted and fused (on a copy: the run's weights stay as they were)
            replay = {"bare": 0.0, "adapted": 0.0, "fused": 0.0}
            copy_ = copy.deepcopy(denoiser)
            copy_._forward_pre_hooks.clear()
            copy_._forward_hooks.clear()
            copy_.eval()
            per_call = {}
            for shapes, (a, kw) in calls.items():
                def timed(fn):
                    fn()
                    times = []
                    for _ in range(max(3, repeats)):
                        t0 = _now()
                        fn()
                        times.append(_now() - t0)
                    return statistics.median(times)

                def bare(a=a, kw=kw):  # bound now (timed only in this iteration)
                    copy_.disable_adapters()
                    try:
                        copy_(*a, **kw)
                    finally:
                        copy_.enable_adapters()

                adapted = timed(lambda a=a, kw=kw: copy_(*a, **kw))
                bare_s = timed(bare)
                with model_base.inference_lora(copy_, fuse=True) as how:
                    fused = timed(lambda a=a, kw=kw: copy_(*a, **kw))
                per_call[shapes] = {"n": counts[shapes] // repeats, "bare": bare_s, "adapted": adapted,
                                    "fused": fused, "lora_context": how}
                for key, value in (("bare", bare_s), ("adapted", adapted), ("fused", fused)):
                    replay[key] += value * counts[shapes] / repeats
    finally:
        for h in handles:
            h.remove()
        for name, fn in originals.items():
            setattr(policy, name, fn)
        step_owner.step = step_original
        sampler_base.inference_lora, sampler_ode.inference_lora = lora_base, lora_ode
    median = {part: statistics.median(s[part] for s in splits) for part in PARTS}
    return {"recipe": recipe, "rollout": statistics.median(totals), "rollouts": totals, "split": median,
            "replay": replay, "per_call": per_call, "threads": torch.get_num_threads(),
            "rows": len(args[1]) * args[2], "clock": "process" if _now is time.process_time else "wall"}


def print_profile(p: dict) -> None:
    total, floor = p["rollout"], p["replay"]["bare"]
    print(f"\n{p['recipe']}: one rollout of {p['rows']} rows, median {total:.3f} {p['clock']} s over "
          f"{len(p['rollouts'])} ({p['threads']} threads); floor (bare forwards, adapters off) {floor:.3f} s = rollout / floor "
          f"{total / floor:.2f}x")
    print(f"  {'part':<46} {'seconds':>8} {'% of gap':>9}")
    gap = total - floor
    lora_extra = p["replay"]["adapted"] - floor
    rows = [("floor: bare denoiser forwards (replayed)", floor, None),
            ("LoRA branch: adapted - bare forwards (replayed)", lora_extra, lora_extra / gap),
            ("denoiser as run - adapted replay (call overhead)", p["split"]["denoiser"] - p["replay"]["adapted"],
             (p["split"]["denoiser"] - p["replay"]["adapted"]) / gap)]
    for part in PARTS[1:]:
        rows.append((LABELS[part], p["split"][part], p["split"][part] / gap))
    for label, seconds, share in rows:
        print(f"  {label:<46} {seconds:8.3f} {'' if share is None else f'{100 * share:8.0f}%'}")
    print(f"  fused forwards (replayed): {p['replay']['fused']:.3f} s = {p['replay']['fused'] / floor:.3f}x the floor;"
          f" adapted {p['replay']['adapted'] / floor:.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per recipe (after one warm-up)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall seconds, or this process's CPU seconds (with OMP_NUM_THREADS=1: for a loaded machine)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    global _now
    _now = CLOCKS[a.clock]
    out = []
    for recipe in a.recipes:
        out.append(profile(recipe, a.repeats, a.overrides))
        print_profile(out[-1])
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
