"""The rollout-vs-recompute log-prob gap under classifier-free guidance, for every model family's tiny model.

A policy-gradient method (DDPO, Flow-GRPO, GRPO-Guard) stores log π_old(x_{k+1} | x_k) while sampling and recomputes
log π_θ of the same transition in its training forward; before the first update θ = θ_old, so the ratio
ρ = exp(log π_recompute − log π_rollout) must be 1 and any deviation is float noise that eats into the clip range ε_c
(Flow-GRPO's default 1e-4). A reported user case (verl-omni#280) saw that gap grow about 20× with CFG on. This
script measures it: for each tiny model (SD1.x ε, SDXL ε, SD3-format flow, FLUX with the guidance embedding — no CFG
batch — Wan 2.1 and Wan 2.2 with its two experts), each guidance scale and each precision it samples one stochastic rollout with stored
log-probs (flow models: the Flow-GRPO SDE, a = 0.7; ε-models: DDIM, η = 1), then recomputes every transition as the
training forward does (`diffalign.samplers.rollout.recompute_log_probs`, unconditional branch detached as Flow-GRPO
trains), with a LoRA of random non-zero values (a trained policy's, not the no-op fresh one) and prints

    |Δ log π| = |log π_rollout − log π_recompute| per step (max and mean over rows and steps) and max |ρ − 1|,

recomputing the rollout's batch as it was sampled, and (last column) each row alone, a minibatch of 1 as a training
minibatch that does not batch the rows as the rollout did (other kernels, other rounding).

Precisions: ``fp32`` (rollout and recompute in float32), ``bf16`` (both under CPU bfloat16 autocast) and ``mixed``
(rollout in float32, recompute under bf16 autocast: ``trainer.mixed_precision=bf16`` with an fp32 rollout, a known
cause of the alarm). Rows where the CPU cannot autocast to bfloat16 print ``n/a``.

    python scripts/logprob_gap.py                           # every family, guidance 1 4.5 7, all precisions
    python scripts/logprob_gap.py --families sd3 flux --guidance 1 7 --precisions fp32

The figures and the clip-range guidance that follows from them are in docs/guides/online.md#log-prob-gap-under-cfg.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
PRECISIONS = ("fp32", "bf16", "mixed")


def _builders() -> dict[str, Callable[[], object]]:
    from diffalign.models.tiny_flow import build_tiny_flow_policy
    from diffalign.models.tiny_flux import build_tiny_flux_policy
    from diffalign.models.tiny_random import build_tiny_random_policy
    from diffalign.models.tiny_sdxl import build_tiny_sdxl_policy
    from diffalign.models.tiny_video import build_tiny_wan22_policy, build_tiny_wan_policy

    return {"sd15": lambda: build_tiny_random_policy(seed=0, lora_rank=4),           # model=tiny_random
            "sdxl": lambda: build_tiny_sdxl_policy(seed=0, lora_rank=4),             # model=tiny_sdxl_random
            "sd3": lambda: build_tiny_flow_policy(seed=0, lora_rank=4),              # model=tiny_flow_random
            "flux": lambda: build_tiny_flux_policy(seed=0, lora_rank=4),             # model=tiny_flux_random
            "wan": lambda: build_tiny_wan_policy(seed=0, num_frames=5, lora_rank=4),  # model=tiny_wan_random
            "wan22": lambda: build_tiny_wan22_policy(seed=0, num_frames=5, lora_rank=4)}  # model=tiny_wan22_random


FAMILIES = ("sd15", "sdxl", "sd3", "flux", "wan", "wan22")


@dataclass
class Gap:
    """One measurement: `max_abs`/`mean_abs` of |Δ log π| over rows and steps, `max_ratio_dev` of |ρ − 1|;
    `None` everywhere when the precision is not available on this CPU."""

    family: str
    guidance_scale: float
    precision: str
    max_abs: float | None
    mean_abs: float | None
    max_ratio_dev: float | None
    per_step: list[float] | None  # max over rows of |Δ log π| at each step k
    rebatched_max_abs: float | None = None  # max |Δ log π| when each row is recomputed alone (a minibatch of 1)


def build_policy(family: str, lora_std: float = 0.02, seed: int = 1):
    """The tiny policy of `family` (one of `FAMILIES`) with every LoRA matrix set to N(0, `lora_std`²) values (a fresh
    LoRA B is zero and the rollout would skip the adapter).

    Raises:
        ValueError: for an unknown family.
    """
    builders = _builders()
    if family not in builders:
        raise ValueError(f"--families: unknown family {family!r}; pass some of {FAMILIES}")
    policy = builders[family]()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * lora_std)
    return policy


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def bf16_available() -> bool:
    """Whether a small matmul runs under CPU bfloat16 autocast here."""
    try:
        with _autocast(True):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except RuntimeError:
        return False


def measure(policy, family: str, guidance_scale: float, precision: str = "fp32", *, num_inference_steps: int = 4,
            seed: int = 0) -> Gap:
    """Samples one stochastic rollout of `PROMPTS` and recomputes its log-probs (see the module docstring).

    Args:
        policy (`DiffusionPolicy`): a tiny policy (`build_policy`).
        guidance_scale (`float`): w ≥ 1 (1: no CFG batch; FLUX embeds it instead).
        precision (`str`): "fp32", "bf16" or "mixed".
        num_inference_steps (`int`): K.

    Returns:
        `Gap` (log-probs in nats, mean-reduced over latent elements as the clipped methods store them).

    Raises:
        ValueError: for an unknown precision.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    from diffalign.samplers.base import build_sampler
    from diffalign.samplers.rollout import recompute_log_probs, rollout

    if precision not in PRECISIONS:
        raise ValueError(f"--precisions: unknown precision {precision!r}; pass some of {PRECISIONS}")
    if precision != "fp32" and not bf16_available():
        return Gap(family, guidance_scale, precision, None, None, None, None)
    is_flow = isinstance(policy.scheduler, FlowMatchEulerDiscreteScheduler)
    generator = [torch.Generator().manual_seed(seed + i) for i in range(len(PROMPTS))]
    with _autocast(precision == "bf16"):
        option = {"name": "flow_sde", "noise_level": 0.7} if is_flow else {"name": "ddim", "eta": 1.0}
        sampler = build_sampler({**option, "num_inference_steps": num_inference_steps,
                                 "guidance_scale": guidance_scale})
        traj = rollout(policy, PROMPTS, sampler, generator=generator, decode=False)
    steps = [k for k in range(num_inference_steps) if bool(traj.trainable[k])]
    with torch.no_grad(), _autocast(precision in ("bf16", "mixed")):
        recomputed = recompute_log_probs(policy, traj, steps, detach_unconditional=True)
        alone = torch.cat([recompute_log_probs(policy, traj.index([i]), steps, detach_unconditional=True)
                           for i in range(len(PROMPTS))])
    delta = (recomputed.float() - traj.log_probs[:, steps].float()).abs()
    rebatched = (alone.float() - traj.log_probs[:, steps].float()).abs()
    return Gap(family, guidance_scale, precision, float(delta.max()), float(delta.mean()),
               float(torch.expm1(delta).max()), [float(d) for d in delta.max(dim=0).values], float(rebatched.max()))


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else ("0" if x == 0 else f"{x:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), help=f"some of {FAMILIES}")
    p.add_argument("--guidance", nargs="+", type=float, default=[1.0, 4.5, 7.0], help="guidance scales w ≥ 1")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), help=f"some of {PRECISIONS}")
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps K")
    args = p.parse_args()
    for flag, values, allowed in (("--families", args.families, FAMILIES), ("--precisions", args.precisions,
                                                                             PRECISIONS)):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise SystemExit(f"logprob_gap.py: error: {flag} {bad}: pass some of {allowed}")
    if any(not w >= 1 for w in args.guidance):
        raise SystemExit(f"logprob_gap.py: error: --guidance {args.guidance}: every scale must be >= 1")
    if args.steps < 1:
        raise SystemExit(f"logprob_gap.py: error: --steps {args.steps}: pass an integer >= 1")
    torch.manual_seed(0)
    print("| family | guidance | precision | max abs(Δ log π) | mean abs(Δ log π) | max abs(ρ − 1) | "
          "gap / gap(w=1) | max abs(Δ log π), minibatch of 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.families:
        policy = build_policy(family)
        for precision in args.precisions:
            base = None
            for w in args.guidance:
                gap = measure(policy, family, w, precision, num_inference_steps=args.steps)
                if w == 1.0:
                    base = gap.max_abs
                growth = ("–" if base in (None, 0) or gap.max_abs is None or w == 1.0
                          else f"{gap.max_abs / base:.1f}×")
                print(f"| {family} | {w:g} | {precision} | {_fmt(gap.max_abs)} | {_fmt(gap.mean_abs)} | "
                      f"{_fmt(gap.max_ratio_dev)} | {growth} | {_fmt(gap.rebatched_max_abs)} |", flush=True)
    print(f"\nclip range of Flow-GRPO/GRPO-Guard: ε_c = 1e-4 (ln(1 + 1e-4) = {math.log1p(1e-4):.3e} nats)")


if __name__ == "__main__":
    main()
