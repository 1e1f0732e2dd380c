"""Benchmark diffalign's `rollout` against `StableDiffusionPipeline.__call__` on the same model, scheduler and seeds.

Rolls out `--batch` images × `--steps` DDIM steps with classifier-free guidance both ways, checks that the images
match, and prints the median wall time of each, their ratio (target: diffalign / diffusers ≤ 1.05) and the ratio of
the rollout to the sum of its bare UNet forwards (the floor any sampler pays).

    python scripts/bench_rollout.py                              # tiny random SD model, CPU
    python scripts/bench_rollout.py --pretrained /models/sd15 --device cuda --dtype float16

Dev tool only; never imported by the package.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from diffalign.models.stable_diffusion import StableDiffusionPolicy
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.samplers.ddim_logprob import DDIMSampler
from diffalign.samplers.rollout import rollout

PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow square", "three yellow circles"]


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Seconds taken by one call of `fn` (synchronising CUDA around it) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--eta", type=float, default=1.0)
    parser.add_argument("--pretrained", default=None, help="local diffusers SD folder; default: tiny random model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    if args.pretrained is None:
        policy = build_tiny_random_policy(seed=0)
    else:
        policy = StableDiffusionPolicy.from_pretrained(args.pretrained, torch_dtype=args.dtype, local_files_only=True)
    policy.to(device)
    pipe = policy.to_pipeline()  # shares the UNet (with its adapter), VAE, text encoder and scheduler
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]

    def generators():
        return [torch.Generator(device).manual_seed(1000 + i) for i in range(args.batch)]

    common = {"num_inference_steps": args.steps, "guidance_scale": args.guidance, "eta": args.eta}

    def run_diffalign():
        sampler = DDIMSampler(num_inference_steps=args.steps, guidance_scale=args.guidance, eta=args.eta)
        return rollout(policy, prompts, sampler, generator=generators()).images

    def run_diffusers():
        return pipe(prompts, generator=generators(), output_type="pt", **common).images

    embeds = policy.encode_prompts(prompts)
    latents = torch.randn(args.batch, *policy.latent_shape, device=device, dtype=policy.dtype)
    policy.scheduler.set_timesteps(args.steps, device=device)
    timesteps = policy.scheduler.timesteps

    @torch.no_grad()
    def run_unet_only():
        for t in timesteps:
            policy.predict(latents, t, embeds, args.guidance)

    # one warm-up each, then interleave the three so that background load affects them alike
    runs = (("diffalign", run_diffalign), ("diffusers", run_diffusers), ("unet", run_unet_only))
    for _, fn in runs:
        fn()
    results = {name: [] for name, _ in runs}
    images = {}
    for _ in range(args.repeats):
        for name, fn in runs:
            seconds, out = timed(fn, device)
            results[name].append(seconds)
            images[name] = out
    median = {name: statistics.median(values) for name, values in results.items()}

    max_diff = (images["diffalign"].float() - images["diffusers"].float()).abs().max().item()
    print(
        f"model={'tiny_random' if args.pretrained is None else args.pretrained} device={device} dtype={args.dtype}"
        f" threads={torch.get_num_threads()} batch={args.batch} steps={args.steps} guidance={args.guidance}"
        f" eta={args.eta} repeats={args.repeats}"
    )
    print(f"images match: {max_diff <= 1e-4} (max |diff| = {max_diff:.2e})")
    print(f"diffalign rollout : {median['diffalign'] * 1e3:9.1f} ms (median)")
    print(f"diffusers pipeline: {median['diffusers'] * 1e3:9.1f} ms (median)")
    print(f"bare UNet forwards: {median['unet'] * 1e3:9.1f} ms (median, {args.steps} guided forwards)")
    print(f"ratio diffalign / diffusers = {median['diffalign'] / median['diffusers']:.3f} (target <= 1.05)")
    print(f"ratio diffalign / bare UNet = {median['diffalign'] / median['unet']:.3f}")


if __name__ == "__main__":
    main()
