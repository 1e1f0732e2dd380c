"""The structured configs of the training loops' own config groups, ``trainer`` (both loops) and ``online`` (the online
loop), registered as ``schema/trainer/default`` and ``schema/online/default`` (`diffalign.config.schemas`); the YAML
options ``configs/trainer/default.yaml`` and ``configs/online/default.yaml`` only extend them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffalign.config.schemas import config_schema


@config_schema("trainer", "default")
@dataclass
class TrainerConfig:
    """The ``trainer`` group: optimisation, precision, logging and checkpoints of both loops (``configs/trainer/``).

    The preference loop takes ``max_steps`` optimizer steps of ``gradient_accumulation_steps`` micro-batches of
    ``batch_size`` items per process and checkpoints every ``checkpointing_steps``; the online loop sizes its
    micro-batches with ``batch_size`` and counts epochs instead (``online``).
    """

    max_steps: int = 100
    batch_size: int = 16
    gradient_accumulation_steps: int = 1
    # the optimizer, built as hydra.utils.instantiate(optimizer, params=<the trainable parameters>): any class taking
    # the parameters first, e.g. trainer.optimizer._target_=bitsandbytes.optim.AdamW8bit, or torch.optim.SGD with
    # ~trainer.optimizer.betas ~trainer.optimizer.eps +trainer.optimizer.momentum=0.9 (its other arguments: +...)
    optimizer: Any = field(default_factory=lambda: {
        "_target_": "torch.optim.AdamW", "lr": 1.0e-4, "betas": [0.9, 0.999], "weight_decay": 0.0, "eps": 1.0e-8})
    lr_scheduler: str = "constant_with_warmup"  # constant_with_warmup | cosine (both with linear warmup)
    lr_warmup_steps: int = 10
    max_grad_norm: float | None = 1.0  # null: no clipping
    mixed_precision: str = "no"  # no | fp16 | bf16 (trainable LoRA parameters stay fp32)
    log_with: str = "tensorboard"  # tensorboard | wandb | none (or any tracker accelerate knows;
                                   # docs/guides/reliability.md)
    # preference loop: optimizer steps between two console summaries of the repeating warnings (saturation, skipped
    # updates, truncated prompts, ...): one line per kind, counts to the trackers (online loop: once per epoch)
    warnings_every: int = 10
    checkpointing_steps: int | None = 50
    keep_last: int = 2  # keep this many newest checkpoints; -1 keeps all
    cpu: bool = False  # force CPU even when a GPU is present
    # false: torch.backends.cuda.enable_cudnn_sdp(False) for the run, so attention uses PyTorch's flash or
    # memory-efficient kernel (cuDNN's attention backward failed at FLUX.1-dev's shapes on an H200 with torch 2.11 +
    # CUDA 13.0: docs/guides/flux.md#memory)
    cudnn_attention: bool = True
    # a non-finite loss or gradient skips that update (counted, logged as nonfinite_skips); after this many skips in a
    # row the run saves a checkpoint and stops with a message
    max_consecutive_nonfinite: int = 5
    # preference loop: VAE-encode each data item once per run and reuse its latents (every built-in data set returns
    # the same item for the same index); falls back to encoding every batch when the latents would exceed 2 GiB
    cache_latents: bool = True


@config_schema("online", "default")
@dataclass
class OnlineConfig:
    """The ``online`` group: rollouts, advantages and epochs of the online loop (``configs/online/``; used by DGPO,
    Flow-GRPO, DDPO, ViPO and DiffusionNFT, docs/guides/online.md)."""

    prompts: str | None = "train"  # train | heldout | a .jsonl/.txt/.csv prompt file; null: required (a recipe's)
    num_epochs: int = 20
    groups_per_epoch: int = 8  # prompts per epoch, one group each; divisible by the processes with split=groups
    split: str = "groups"  # several processes: whole groups per process | members: every group spread over them
    group_size: int = 8  # G samples per prompt (DGPO paper 24, code 16; Flow-GRPO 24)
    rollout_batch_size: int = 64  # images per rollout forward batch (the noise does not depend on it)
    # true: each group's prompt encoded once per epoch instead of once per sample (faster rollouts; the embeddings
    # then differ by float rounding, ~1e-7, docs/results/performance.md#encoding-each-prompt-once)
    encode_prompts_once: bool = False
    # a trained LoRA fused into the denoiser's weights for the rollout (the bare denoiser's cost, no LoRA branch; the
    # samples then differ by float rounding): "auto" when the rollout stores no log-probs (a deterministic sampler:
    # DGPO, DiffusionNFT), never for a stochastic one (exact log-probs) | true: always | false: never
    # (docs/results/performance.md#fusing-the-rollouts-lora)
    fuse_rollout_lora: str | bool = "auto"
    shared_initial_noise: bool = False  # true: one initial noise per group (DanceGRPO/ViPO); DGPO/Flow-GRPO: not
    advantage_std: str = "group"  # group | global | none (docs/methods/algorithms.md#group-advantages)
    # std over n - this: 0 population (np.std: flow_grpo, DGPO) | 1 sample (DanceGRPO/ViPO)
    advantage_std_correction: int = 0
    # A = (r - mean) / (std + eps): 1e-4 flow_grpo/DGPO, 1e-8 ViPO (DDPO's tracker: 1e-6, fixed)
    advantage_eps: float = 1.0e-4
    advantage_clip: float | None = 5.0
    best_of_n: int | None = None  # policy-gradient methods: the n/2 best + n/2 worst of each group (DanceGRPO/ViPO)
    updates_per_epoch: int = 1  # optimizer steps per epoch (released code: DGPO 1, Flow-GRPO 2)
    num_inner_epochs: int = 1  # passes over an epoch's samples (policy-gradient methods)
    tracker_buffer_size: int = 16  # DDPO's per-prompt statistics
    tracker_min_count: int = 16
    checkpointing_epochs: int | None = 10
    # true: an EMA of the LoRA weights beside the trained ones, evaluated and exported as final/ (Flow-GRPO's and
    # DGPO's released code: decay 0.9, every 8th optimizer step, d_t = min((1+t)/(10+t), decay);
    # diffalign.train.ema); rollouts, the loss and the resumable checkpoint weights stay the live ones
    ema: bool = False
    ema_decay: float = 0.9
    ema_update_interval: int = 8
