"""``diffalign-ddcpp-targets``: trains DDSPO's DD-CPP target policies φ^w and φ^l (Kim et al., arXiv:2512.23426;
docs/methods/algorithms.md#ddspo-data, step 4).

Two LoRAs on the frozen base model, each fine-tuned with the plain denoising loss (`diffalign.objectives.sft.
WinnerSFT`, ε-MSE with its own noise) on one side of a preference data set: φ^w on the preferred images, φ^l on the
dispreferred ones. They are written as diffusers LoRA folders ``<out>/winner`` and ``<out>/loser``, which
``method=ddspo method.cpp=dd method.target_lora_w=<out>/winner method.target_lora_l=<out>/loser`` loads.

Paper defaults (authors' ``scripts/train_ddspo_lora_target.sh``): LoRA rank 4, alpha 4, lr 1e-4, 300 steps, batch 2048
(1 × accumulation 2048), Pick-a-Pic pairs; DDSPO then runs with β = 8000.

    diffalign-ddcpp-targets --out runs/ddcpp --steps 300 -- model=tiny_sd data=shapes_pairs
    diffalign-ddcpp-targets --out /ckpt/ddcpp_sd15 --batch-size 8 --accumulation 256 -- \\
        model=sd15 data=pickapic data.path=/data/pickapic_v2/data

Everything after ``--`` is a Hydra override of the ``diffalign-train`` config (model, data, reward, seed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from diffalign.config.compose import CONFIG_DIR, setup_hydra
from diffalign.data.preference import ResumableSampler
from diffalign.lora.initial import model_config
from diffalign.objectives.sft import WinnerSFT
from diffalign.rewards.reward_set import build_selected_rewards
from diffalign.runtime.console import quiet_on_broken_pipe
from diffalign.train.preference import data_latents
from diffalign.types import WinnerBatch


def train_side(cfg, side: str, args, out: Path) -> float:
    """Fine-tunes a fresh LoRA on side "w" (winners) or "l" (losers) and saves it; returns the last loss."""
    policy = instantiate(model_config(cfg.model), lora_rank=args.rank, lora_alpha=args.alpha, lora_seed=args.seed)
    policy.to(args.device)
    latent_h = policy.latent_shape[1]
    kwargs = {}
    if "resolution" in cfg.data and cfg.data.resolution is None:
        kwargs["resolution"] = latent_h * policy.vae_scale_factor
    dataset = instantiate(cfg.data, **kwargs)
    if callable(getattr(dataset, "prepare", None)):
        dataset.prepare(policy, build_selected_rewards(cfg.reward))
    sampler = ResumableSampler(len(dataset), args.batch_size, seed=args.seed, shuffle=True, drop_last=True)
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    objective = WinnerSFT()
    generator = torch.Generator().manual_seed(args.seed + (0 if side == "w" else 1))
    policy.unet.train()
    loss_value = float("nan")
    for step in range(args.steps):
        total = 0.0
        for _ in range(args.accumulation):
            batch_data = dataset.collate(sampler.next_batch())
            with torch.no_grad():
                latents = data_latents(policy, batch_data, side, args.device)
                embeds = policy.encode_prompts(batch_data["prompts"], do_classifier_free_guidance=False)
            loss, _ = objective(policy, WinnerBatch(latents, batch_data["prompts"], embeds), generator=generator)
            (loss / args.accumulation).backward()
            total += loss.item() / args.accumulation
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = total
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"[ddcpp {side}] step {step + 1}/{args.steps} loss {total:.4f}", flush=True)
    folder = out / ("winner" if side == "w" else "loser")
    policy.save_lora_weights(folder)
    return loss_value


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> None:
    """Entry point of ``diffalign-ddcpp-targets`` (`argv` defaults to ``sys.argv[1:]``)."""
    if argv is None:
        argv = sys.argv[1:]
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    else:
        overrides = []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="writes <out>/winner and <out>/loser")
    parser.add_argument("--steps", type=int, default=300, help="paper: 300")
    parser.add_argument("--lr", type=float, default=1e-4, help="paper: 1e-4")
    parser.add_argument("--rank", type=int, default=4, help="paper: 4")
    parser.add_argument("--alpha", type=float, default=4.0, help="paper: 4")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=1, help="paper: batch 2048 in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    for side in ("w", "l"):
        train_side(cfg, side, args, out)
    print(f"[ddcpp] wrote {out / 'winner'} and {out / 'loser'}")


if __name__ == "__main__":
    main()
