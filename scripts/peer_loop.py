"""A minimal peer of diffalign's online loop: the released Flow-GRPO and DDPO inner loops written plainly on diffusers +
peft, and the epoch time of diffalign's loop over this one's, measured in one run.

The peer loop (everything above ``# ---- the comparison``) imports no diffalign: it is what a user of the released
code runs, re-implemented from the structure of yifan123/flow_grpo ``scripts/train_sd3.py`` (sampling with
``pipeline_with_logprob`` / ``sde_step_with_logprob``, group advantages from a per-prompt tracker, then for every
minibatch and every trained timestep j: ``compute_log_prob`` with a guided forward, the KL to the adapter-free
transformer, the clipped ratio, backward with accumulation) and of kvablack/ddpo-pytorch ``train.py`` (DDIM-η
sampling with ``ddim_step_with_logprob``, the per-prompt stat tracker, a per-sample permutation of the timesteps,
the clipped ratio per timestep). One epoch of the peer:

1. encodes the epoch's prompts (and the negative "") with the pipeline's own ``encode_prompt``;
2. samples ``group_size`` images per prompt in batches of ``rollout_batch_size`` with classifier-free guidance,
   storing the latents and each step's log-prob (mean over the latent's elements, as both released loops);
3. scores them (``reward_fn``: images (B, 3, H, W) in [0, 1] → (B,));
4. normalises the rewards per prompt: (r − mean) / (std + eps) over the prompt's samples (Flow-GRPO: eps 1e-4; DDPO:
   a running per-prompt buffer, the global statistics until a prompt has ``min_count`` rewards), clipped to ±5;
5. one optimizer update over the epoch (the tiny recipes' ``updates_per_epoch: 1``): for each minibatch of
   ``batch_size`` rows and each trained transition j, the PPO-clip loss (PPO eq. 7), plus β_KL times the Gaussian
   KL to the adapter-free model for Flow-GRPO, backward divided by the number of (minibatch, transition) units; then
   gradient clipping (norm 1) and an AdamW step on the LoRA parameters.

The models, LoRA (rank 8, alpha 8, the policy's target modules, gaussian init), batch sizes, sampler settings and
optimizer are those of ``recipe=tiny_flow_grpo`` (tiny SD3-format flow model) and ``recipe=tiny_ddpo`` (tiny SD).

    python scripts/peer_loop.py                         # both, 3 interleaved repeats after a warm-up epoch each
    python scripts/peer_loop.py --methods ddpo --repeats 5
    python scripts/peer_loop.py --quick                 # small epochs (2 prompts x 4, 4 steps): a smoke test

It prints diffalign's epoch time over the peer's per method, the median of alternating epochs (diffalign, peer,
diffalign, peer, ...) in one process, both with the same reward (``brightness``: mean luma, BT.601).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "diffalign" / "assets"
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# ----------------------------------------------------------------------------------------------- the peer's steps


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std²) per element, averaged over every non-batch dim: `(B,)`."""
    elem = -((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return elem.mean(dim=tuple(range(1, x.ndim)))


def ddim_step_with_logprob(scheduler, eps: torch.Tensor, t: torch.Tensor, latents: torch.Tensor, eta: float,
                           prev_sample: torch.Tensor | None = None, generator=None):
    """One DDIM-η step from timestep `t` (`(B,)` ints, one per row) of a diffusers `DDIMScheduler` after
    ``set_timesteps``, with the log-prob of the next latents (DDIM, Song et al. 2020, eq. 12; the Gaussian of
    ddpo-pytorch's ``ddim_step_with_logprob``). Returns (prev_sample, log_prob `(B,)`, mean, std)."""
    step = scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alphas = scheduler.alphas_cumprod.to(latents.device)
    shape = (-1,) + (1,) * (latents.ndim - 1)
    a_t = alphas[t].view(shape)
    prev_t = t - step
    a_prev = torch.where(prev_t >= 0, alphas[prev_t.clamp(min=0)], scheduler.final_alpha_cumprod.to(alphas)).view(shape)
    x0 = (latents - (1 - a_t).sqrt() * eps) / a_t.sqrt()
    variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std = eta * variance.sqrt()
    mean = a_prev.sqrt() * x0 + (1 - a_prev - std**2).sqrt() * eps
    if prev_sample is None:
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
        prev_sample = mean + std * noise
    return prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std


def sde_step_with_logprob(sigma: torch.Tensor, sigma_next: torch.Tensor, sigma_max: float, v: torch.Tensor,
                          latents: torch.Tensor, noise_level: float, prev_sample: torch.Tensor | None = None,
                          generator=None):
    """One step of Flow-GRPO's SDE (arXiv:2505.05470, eq. 9–10) from σ to σ_next (`(B,)` each), with the log-prob of
    the next latents: σ_t = a·sqrt(σ / (1 − σ)) (σ_max in place of σ = 1), μ = x(1 + σ_t²Δ/(2σ)) +
    v(1 + σ_t²(1 − σ)/(2σ))Δ, s = σ_t·sqrt(−Δ). Returns (prev_sample, log_prob `(B,)`, mean, σ_t)."""
    shape = (-1,) + (1,) * (latents.ndim - 1)
    sigma, sigma_next = sigma.view(shape).float(), sigma_next.view(shape).float()
    dt = sigma_next - sigma
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma >= 1, torch.full_like(sigma, sigma_max), sigma)))
    mean = latents * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
        prev_sample = mean + std * noise
    return prev_sample, gaussian_log_prob(prev_sample, mean, std), mean, std_t


class PerPromptStatTracker:
    """Per-prompt reward normalisation (DDPO's stat tracker): a buffer of the last `buffer_size` rewards per prompt;
    a prompt with fewer than `min_count` uses the batch's mean and std. `buffer_size` None: this epoch's rewards only
    (Flow-GRPO's group advantages)."""

    def __init__(self, buffer_size: int | None, min_count: int, eps: float):
        self.buffer_size, self.min_count, self.eps, self.stats = buffer_size, min_count, eps, {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rewards)
        for prompt in dict.fromkeys(prompts):
            rows = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            if self.buffer_size is None:
                seen = rewards[rows]
            else:
                self.stats.setdefault(prompt, deque(maxlen=self.buffer_size)).extend(rewards[rows].tolist())
                seen = torch.tensor(list(self.stats[prompt]))
            if len(seen) < self.min_count:
                seen = rewards
            out[rows] = (rewards[rows] - seen.mean()) / (seen.std(unbiased=False) + self.eps)
        return out


@dataclass
class PeerConfig:
    """The settings of one peer run (those of the matching tiny recipe)."""

    method: str  # "flow_grpo" | "ddpo"
    groups_per_epoch: int = 8
    group_size: int = 8
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.7  # Flow-GRPO's SDE
    eta: float = 1.0  # DDPO's DDIM
    rollout_batch_size: int = 64
    batch_size: int = 16
    timestep_fraction: float = 0.99
    clip_range: float = 1e-4
    beta_kl: float = 0.0
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    lora_rank: int = 8
    adv_clip: float = 5.0
    adv_eps: float = 1e-4
    tracker_buffer_size: int | None = None
    tracker_min_count: int = 0
    seed: int = 0


PEERS = {
    "flow_grpo": PeerConfig("flow_grpo", num_inference_steps=10, guidance_scale=4.5, timestep_fraction=0.99,
                            beta_kl=0.04, learning_rate=1e-3),
    "ddpo": PeerConfig("ddpo", num_inference_steps=20, guidance_scale=4.0, eta=1.0, timestep_fraction=0.5,
                       learning_rate=2e-3, adv_eps=1e-6, tracker_buffer_size=16, tracker_min_count=8),
}
SD3_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out"]
SD_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class PeerLoop:
    """The peer's model, optimizer and epoch (module docstring). `reward_fn(images (B, 3, H, W) in [0, 1], prompts)`
    returns `(B,)` scores."""

    def __init__(self, cfg: PeerConfig, prompts: list[str], reward_fn, device: str = "cpu"):
        from diffusers import DDIMScheduler, StableDiffusion3Pipeline, StableDiffusionPipeline
        from peft import LoraConfig

        self.cfg, self.prompts, self.reward_fn, self.device = cfg, prompts, reward_fn, torch.device(device)
        self.flow = cfg.method == "flow_grpo"
        if self.flow:
            self.pipe = StableDiffusion3Pipeline.from_pretrained(ASSETS / "tiny_sd3", text_encoder_3=None,
                                                                 tokenizer_3=None)
            self.model, targets = self.pipe.transformer, SD3_TARGETS
        else:
            self.pipe = StableDiffusionPipeline.from_pretrained(ASSETS / "tiny_sd", safety_checker=None,
                                                                requires_safety_checker=False)
            self.pipe.scheduler = DDIMScheduler.from_config(self.pipe.scheduler.config)
            self.model, targets = self.pipe.unet, SD_TARGETS
        self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        for module in (self.pipe.vae, self.pipe.text_encoder, getattr(self.pipe, "text_encoder_2", None)):
            if module is not None:
                module.requires_grad_(False)
        self.model.requires_grad_(False)
        torch.manual_seed(cfg.seed)
        self.model.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank, init_lora_weights="gaussian",
                                          target_modules=targets))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        self.tracker = PerPromptStatTracker(cfg.tracker_buffer_size, cfg.tracker_min_count, cfg.adv_eps)
        self.epoch = 0

    # -- text and the denoiser
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Guided conditioning rows for `prompts`: ``[negatives; positives]`` (2B rows); the rollouts store them for
        the update, as the released loops do."""
        with torch.no_grad():
            if self.flow:
                pos, neg, pooled, neg_pooled = self.pipe.encode_prompt(
                    prompts, prompts, None, negative_prompt=[""] * len(prompts), negative_prompt_2=[""] * len(prompts),
                    do_classifier_free_guidance=True, device=self.device, max_sequence_length=8)
                return {"encoder_hidden_states": torch.cat([neg, pos]),
                        "pooled_projections": torch.cat([neg_pooled, pooled])}
            pos, neg = self.pipe.encode_prompt(prompts, self.device, 1, True, negative_prompt=[""] * len(prompts))
            return {"encoder_hidden_states": torch.cat([neg, pos])}

    def guided(self, latents: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        """The guided model output on `latents` `(B, ...)` at per-row timesteps `t` `(B,)`."""
        x, tt = torch.cat([latents, latents]), torch.cat([t, t])
        if self.flow:
            out = self.model(hidden_states=x, timestep=tt, return_dict=False, **cond)[0]
        else:
            out = self.model(x, tt, return_dict=False, **cond)[0]
        uncond, text = out.float().chunk(2)
        return uncond + self.cfg.guidance_scale * (text - uncond)

    # -- 2. sampling with log-probs
    def sample(self, prompts: list[str], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`len(prompts)` rollouts: ``latents`` `(B, K+1, ...)`, ``log_probs`` `(B, K)`, ``timesteps`` `(K,)`,
        ``sigmas`` (flow) and ``images`` `(B, 3, H, W)` in [0, 1]."""
        cfg, sched = self.cfg, self.pipe.scheduler
        sched.set_timesteps(cfg.num_inference_steps, device=self.device)
        cond = self.encode(prompts)
        c, size = self.model.config.in_channels, self.model.config.sample_size
        x = torch.randn((len(prompts), c, size, size), generator=generator).to(self.device)
        xs, log_probs = [x], []
        with torch.no_grad():
            for k, t in enumerate(sched.timesteps):
                tt = t.expand(len(x))
                out = self.guided(x, tt, cond)
                if self.flow:
                    sig = sched.sigmas.to(self.device)
                    x, lp, _, _ = sde_step_with_logprob(sig[k].expand(len(x)), sig[k + 1].expand(len(x)),
                                                        float(sig[1]), out, x.float(), cfg.noise_level,
                                                        generator=generator)
                else:
                    x, lp, _, _ = ddim_step_with_logprob(sched, out, tt.long(), x.float(), cfg.eta,
                                                         generator=generator)
                xs.append(x)
                log_probs.append(lp)
            vae = self.pipe.vae
            z = x / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
            images = (vae.decode(z.to(vae.dtype), return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)
        out = {"latents": torch.stack(xs, 1), "log_probs": torch.stack(log_probs, 1),
               "timesteps": sched.timesteps.clone(), "images": images,
               **{f"neg_{k}": v[:len(prompts)] for k, v in cond.items()},
               **{f"pos_{k}": v[len(prompts):] for k, v in cond.items()}}
        if self.flow:
            out["sigmas"] = sched.sigmas.clone()
        return out

    def log_prob(self, sample: dict, rows: torch.Tensor, k: torch.Tensor, cond: dict, sched) -> tuple:
        """Recomputed (log_prob `(b,)`, mean, std) of transition `k` (`(b,)` per row) of `rows`, with gradients."""
        x, nxt = sample["latents"][rows, k], sample["latents"][rows, k + 1]
        t = sample["timesteps"][k]
        out = self.guided(x, t, cond)
        if self.flow:
            sig = sample["sigmas"]
            _, lp, mean, std = sde_step_with_logprob(sig[k], sig[k + 1], float(sig[1]), out, x.float(),
                                                     self.cfg.noise_level, prev_sample=nxt)
        else:
            _, lp, mean, std = ddim_step_with_logprob(sched, out, t.long(), x.float(), self.cfg.eta, prev_sample=nxt)
        return lp, mean, std

    # -- one epoch
    def run_epoch(self) -> dict:
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + self.epoch)
        pick = torch.randint(len(self.prompts), (cfg.groups_per_epoch,), generator=gen)
        prompts = [self.prompts[int(i)] for i in pick for _ in range(cfg.group_size)]
        self.model.eval()
        parts = [self.sample(prompts[s:s + cfg.rollout_batch_size], gen)
                 for s in range(0, len(prompts), cfg.rollout_batch_size)]
        sample = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k not in ("timesteps", "sigmas")}
        sample["timesteps"] = parts[0]["timesteps"]
        if self.flow:
            sample["sigmas"] = parts[0]["sigmas"]
        rewards = self.reward_fn(sample["images"], prompts).float().cpu()
        advantages = self.tracker.update(prompts, rewards).clamp(-cfg.adv_clip, cfg.adv_clip).to(self.device)
        # 5. one update: minibatches x trained transitions, gradients accumulated
        self.model.train()
        num_steps = len(sample["timesteps"])
        n_train = max(1, int(num_steps * cfg.timestep_fraction))
        perm = torch.randperm(len(prompts), generator=gen)
        if self.flow:  # Flow-GRPO: transitions 0 .. n-1 in order, the same for every row
            order = torch.arange(num_steps).expand(len(prompts), -1)
        else:  # DDPO: one permutation of the transitions per sample
            order = torch.stack([torch.randperm(num_steps, generator=gen) for _ in prompts])
        units = [(perm[s:s + cfg.batch_size], j) for s in range(0, len(prompts), cfg.batch_size)
                 for j in range(n_train)]
        sched = self.pipe.scheduler
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for rows, j in units:
            k = order[rows, j]
            cond = {k[4:]: torch.cat([sample[k][rows], sample["pos_" + k[4:]][rows]])
                    for k in sample if k.startswith("neg_")}
            lp, mean, std = self.log_prob(sample, rows, k, cond, sched)
            old = sample["log_probs"][rows, k]
            ratio = torch.exp(lp - old)
            adv = advantages[rows]
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)).mean()
            if cfg.beta_kl > 0:
                with torch.no_grad():
                    self.model.disable_adapters()
                    try:
                        _, ref_mean, _ = self.log_prob(sample, rows, k, cond, sched)
                    finally:
                        self.model.enable_adapters()
                kl = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std.flatten() ** 2)
                loss = loss + cfg.beta_kl * kl.mean()
            (loss / len(units)).backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.optimizer.step()
        self.epoch += 1
        return {"reward": float(rewards.mean()), "loss": statistics.fmean(losses), "units": len(units)}


def brightness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Mean luma (ITU-R BT.601) of `(B, 3, H, W)` images in [0, 1]: `(B,)`."""
    w = torch.tensor([0.299, 0.587, 0.114], device=images.device).view(3, 1, 1)
    return (images.float() * w).sum(dim=-3).flatten(1).mean(1)


# ----------------------------------------------------------------------------------------------- the comparison

RECIPE = {"flow_grpo": "tiny_flow_grpo", "ddpo": "tiny_ddpo"}


def quick(cfg: PeerConfig) -> PeerConfig:
    from dataclasses import replace

    return replace(cfg, groups_per_epoch=2, group_size=4, rollout_batch_size=8, batch_size=8, num_inference_steps=4,
                   tracker_min_count=min(cfg.tracker_min_count, 2))


def diffalign_run(method: str, cfg: PeerConfig, out_dir: Path):
    """diffalign's loop on the same settings (its `_setup`; epochs through `_epoch`)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_online import compose_config, setup_run, warning_counts

    from diffalign.train import online as loop

    overrides = [f"recipe={RECIPE[method]}", "reward=[brightness]", "eval.enabled=false", "trainer.log_with=none",
                 "online.checkpointing_epochs=null", "monitor.every=0", "online.num_epochs=1000",
                 f"online.groups_per_epoch={cfg.groups_per_epoch}", f"online.group_size={cfg.group_size}",
                 f"online.rollout_batch_size={cfg.rollout_batch_size}", f"trainer.batch_size={cfg.batch_size}",
                 f"sampler.num_inference_steps={cfg.num_inference_steps}",
                 f"output_dir={out_dir}"]
    if cfg.tracker_min_count >= 1:  # DDPO's per-prompt tracker; Flow-GRPO's peer has none (0, which the config refuses)
        overrides.append(f"online.tracker_min_count={cfg.tracker_min_count}")
    cfg = compose_config(overrides)
    run = setup_run(loop, cfg)
    run.warnings = warning_counts()

    def epoch():
        logs = loop._epoch(run)
        run.epoch += 1
        return logs

    epoch.trainable = sum(p.numel() for p in run.updates.params)
    return epoch


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--repeats", type=int, default=3, help="timed epochs of each loop, alternating")
    p.add_argument("--quick", action="store_true", help="small epochs (2 prompts x 4 samples, 4 steps)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    from diffalign.world.prompts import load_prompts  # (the harness; the loop above imports no diffalign)

    prompts = [r["prompt"] for r in load_prompts("train")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for method in args.methods:
        cfg = quick(PEERS[method]) if args.quick else PEERS[method]
        with tempfile.TemporaryDirectory() as tmp:
            ours = diffalign_run(method, cfg, Path(tmp))
            peer = PeerLoop(cfg, prompts, brightness)
            mine = sum(p.numel() for p in peer.params)
            if mine != ours.trainable:
                print(f"note: {method}: LoRA parameters differ, diffalign {ours.trainable} vs peer {mine}")
            ours(), peer.run_epoch()  # warm-up
            t_ours, t_peer = [], []
            for _ in range(args.repeats):
                for fn, times in ((ours, t_ours), (peer.run_epoch, t_peer)):
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
        a, b = statistics.median(t_ours), statistics.median(t_peer)
        print(f"{method} ({RECIPE[method]}: {cfg.groups_per_epoch} prompts x {cfg.group_size}, "
              f"{cfg.num_inference_steps} steps, batch {cfg.batch_size}): diffalign {a:.2f} s / peer {b:.2f} s per "
              f"epoch = {a / b:.2f}  (median of {args.repeats} alternating epochs; diffalign "
              f"{', '.join(f'{x:.2f}' for x in t_ours)}; peer {', '.join(f'{x:.2f}' for x in t_peer)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
