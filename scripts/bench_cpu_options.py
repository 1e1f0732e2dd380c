"""Which CPU settings make the tiny world's denoiser faster: each option against the default, timed alternately in one
process (A B A B ...) so that both see the same machine state, as a ratio option/default (< 1 = faster).

    python scripts/bench_cpu_options.py                 # every option except torch.compile
    python scripts/bench_cpu_options.py --compile       # also torch.compile (cold compile time, then warm speed)
    python scripts/bench_cpu_options.py --device cuda --dtype float16

Options (the shipped tiny UNet with the main job's LoRA: rank 8 on attention and ResNet convolutions):
- ``lora-off``: the adapter disabled (what `inference_lora` does for a zero adapter, and fusing for a trained one);
- ``threads-1``: one intra-op thread instead of torch's default (the machine's cores);
- ``flush-denormal``: `torch.set_flush_denormal(True)`;
- ``channels-last``: UNet weights and inputs in `torch.channels_last`;
- ``inference-mode``: `torch.inference_mode()` instead of `torch.no_grad()`;
- ``batch-64`` / ``batch-128`` / ``batch-512``: per-image cost at another UNet batch than 256 rows;
- ``bf16-autocast``: `torch.autocast("cpu", torch.bfloat16)` (and the largest output difference);
- ``compile`` (with --compile): `torch.compile(unet)` after its first (compiling) call.
Every option except ``lora-off`` runs the adapter disabled (``bf16-autocast`` too, with 2 repeats whatever --repeats), so that it is compared on the bare
denoiser; their outputs are checked against the default's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="UNet rows per forward (CFG: 2 x images)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = p.parse_args()

    import torch

    from diffalign.config.compose import asset_path
    from diffalign.models.stable_diffusion import StableDiffusionPolicy

    policy = StableDiffusionPolicy.from_pretrained(
        asset_path("tiny_sd"), torch_dtype=args.dtype, lora_rank=8,
        lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]).to(args.device)
    with torch.no_grad():  # a trained-looking adapter, so the LoRA branch does real work
        g = torch.Generator().manual_seed(0)
        for param in policy.trainable_parameters():
            param.copy_(torch.randn(param.shape, generator=g).to(param) * 0.02)
    unet = policy.unet.eval()
    default_threads = torch.get_num_threads()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    g = torch.Generator().manual_seed(1)

    def inputs(batch):
        x = torch.randn(batch, *policy.latent_shape, generator=g).to(args.device, policy.dtype)
        e = torch.randn(batch, policy.tokenizer.model_max_length, unet.config.cross_attention_dim,
                        generator=g).to(args.device, policy.dtype)
        return x, torch.tensor(500, device=args.device), e

    x, t, e = inputs(args.batch)

    def forward(module=unet, xx=x, ee=e):
        out = module(xx, t, encoder_hidden_states=ee).sample
        sync()
        return out

    @contextlib.contextmanager
    def adapter(on: bool):
        if not on:
            unet.disable_adapters()
        try:
            yield
        finally:
            if not on:
                unet.enable_adapters()

    def plain(lora=False):
        with torch.no_grad(), adapter(lora):
            return forward()

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def compare(name, fn, base=plain, per_image_rows=None, check=True):
        fn(), base()  # warm-up
        a, b = [], []
        for _ in range(args.repeats):
            a.append(timed(fn))
            b.append(timed(base))
        ratio = statistics.median(a) / statistics.median(b)
        if per_image_rows:
            ratio *= args.batch / per_image_rows
        diff = ""
        if check:
            diff = f"; max |output - default| {float((fn().float() - base().float()).abs().max()):.1e}"
        print(f"{name:<16} {statistics.median(a) * 1000:8.1f} ms vs {statistics.median(b) * 1000:8.1f} ms: "
              f"{'per-image ' if per_image_rows else ''}ratio {ratio:.2f}{diff}")

    print(f"torch {torch.__version__}, {default_threads} threads, UNet batch {args.batch}, {args.device} {args.dtype}")
    compare("lora-off", plain, base=lambda: plain(lora=True))

    def threads_1():
        torch.set_num_threads(1)
        try:
            return plain()
        finally:
            torch.set_num_threads(default_threads)

    compare("threads-1", threads_1)

    def denormal():
        torch.set_flush_denormal(True)
        try:
            return plain()
        finally:
            torch.set_flush_denormal(False)

    compare("flush-denormal", denormal)

    cl_x = x.contiguous(memory_format=torch.channels_last)

    def channels_last():
        unet.to(memory_format=torch.channels_last)
        try:
            with torch.no_grad(), adapter(False):
                return forward(xx=cl_x)
        finally:
            unet.to(memory_format=torch.contiguous_format)

    compare("channels-last", channels_last)

    def inference_mode():
        with torch.inference_mode(), adapter(False):
            return forward()

    compare("inference-mode", inference_mode)
    for rows in (64, 128, 512):
        xb, _, eb = inputs(rows)

        def other_batch(xb=xb, eb=eb):
            with torch.no_grad(), adapter(False):
                return forward(xx=xb, ee=eb)

        compare(f"batch-{rows}", other_batch, per_image_rows=rows, check=False)
    if args.device == "cpu":
        def bf16():
            with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), adapter(False):
                return forward()

        saved = args.repeats
        args.repeats = 2
        compare("bf16-autocast", bf16)
        args.repeats = saved
    if args.compile:
        compiled = torch.compile(unet)
        t0 = time.perf_counter()
        with torch.no_grad(), adapter(False):
            forward(module=compiled)
        print(f"compile: first call (compiling) {time.perf_counter() - t0:.1f} s")

        def run_compiled():
            with torch.no_grad(), adapter(False):
                return forward(module=compiled)

        compare("compile", run_compiled)


if __name__ == "__main__":
    sys.exit(main())
