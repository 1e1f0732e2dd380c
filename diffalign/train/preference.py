"""Training loop for offline and semi-online preference data (Diffusion-DPO, SePPO; DDSPO plugs in here too).

``main(cfg)`` → setup → train → evaluate. The loop is written out (no Trainer class): one optimizer step per
``trainer.gradient_accumulation_steps`` micro-batches of ``trainer.batch_size`` items, gradient clipping, an LR
schedule with warmup, trackers, and atomic checkpoints every ``trainer.checkpointing_steps`` holding the LoRA (diffusers
format), optimizer, scheduler, data-sampler and reference state, so ``resume=latest`` continues exactly: the
training draws (t, ε, ...) come from one generator per sample seeded by (seed, step, micro-step, global position)
(`sample_generators`), so they need no saved state and do not depend on how the global batch is split across
processes.

Two data flows, chosen by the objective's ``data_flow``:

- ``"pairs"`` (Diffusion-DPO, DDSPO): the data yields ``images_w`` and ``images_l`` (VAE-encoded here), or
  ``latents_w`` and ``latents_l`` directly (DDSPO pairs), and optionally ``degraded_prompts`` (encoded too); the
  objective gets a `PreferenceBatch`;
- ``"winners"`` (SePPO, fine-tuning on winners): only ``images_w`` is used (a pairs data set works too; its losers are
  ignored, and not read when it has ``winners_only``); the objective gets a `WinnerBatch`.

The reference strategy (``cfg.reference``, `diffalign.reference`) is set up on the policy before the optimizer is
built, gets ``on_step(policy, u)`` before every update ``u`` (0-based), is passed to the objective as ``reference=``,
and its state is written as ``reference_state.{json,safetensors}`` into every checkpoint and read back on resume.

Rewards: ``reward=[...]`` is the training set (used by on-policy data such as ``data=ranked_pairs``), ``eval_reward=[...]``
the evaluation set (evaluation and the hacking monitors; the training set when unset). Every reward call is checked
(`diffalign.rewards.guard`): a reward that raises or returns NaN/inf stops the run after a checkpoint is saved, with a
`RewardError` naming the reward, the step, the batch and the prompt. ``monitor.every > 0`` logs a gold reward on fixed
prompts and seeds and the group diversity every that many steps (`diffalign.monitors`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from diffalign.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    new_lineage,
    read_state,
    remove_temporaries,
    save_checkpoint,
    write_state,
)
from diffalign.data.preference import ResumableSampler
from diffalign.data.resumable import prepare_dataset
from diffalign.evaluate import base_reuse_key, eval_config_from, evaluate_policy, select_prompts
from diffalign.faults import NonFiniteError, NonFiniteGuard, StopSignals, TrainingInterrupted
from diffalign.models.base import bare_forward
from diffalign.monitors import build_monitor
from diffalign.plugins import build_selected_rewards
from diffalign.report import write_report
from diffalign.rewards.guard import checked_rewards, set_reward_step, stop_on_reward_error
from diffalign.runlock import run_lock
from diffalign.samplers.groups import stream_seed
from diffalign.types import PreferenceBatch, WinnerBatch
from diffalign.world.prompts import load_prompts

_NOISE_TAG = 20  # stream tag of the training draws (diffalign.samplers.groups.stream_seed)


def sample_generators(seed: int, step: int, micro: int, start: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample of a micro-batch, seeded by (seed, step, micro-step, the sample's position in the
    global batch): global positions ``start .. start + count - 1``.

    The objective draws each sample's t and ε (and any further per-sample draws) from its own generator, so what a
    sample gets depends neither on the number of processes nor on which other samples share its process: N processes
    with batch B draw exactly what one process with batch N·B does, and a resumed run draws what the uninterrupted one
    did (the seeds are a function of the step; no generator state is carried)."""
    return [torch.Generator(device="cpu").manual_seed(stream_seed(seed, step, micro, start + i, _NOISE_TAG))
            for i in range(count)]


def _flat_hparams(cfg: DictConfig) -> dict:
    """Scalar leaves of the config, flattened with '/' for the trackers."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}/")
        elif isinstance(node, (int, float, str, bool)):
            out[prefix[:-1]] = node
        elif node is not None:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def data_latents(policy, batch_data: dict, side: str, device) -> torch.Tensor:
    """The clean latents of one side (`side` "w" or "l") of a data batch: ``latents_<side>`` as given (data sets that
    store latents, e.g. DDSPO pairs), else ``images_<side>`` encoded with `policy.encode_images`. Float32 on
    `device`."""
    if f"latents_{side}" in batch_data:
        return batch_data[f"latents_{side}"].to(device=device, dtype=torch.float32)
    return policy.encode_images(batch_data[f"images_{side}"].to(device))


class LatentCache:
    """The clean latents of a data set's items, VAE-encoded once per run instead of at every step they are drawn.

    Valid because every built-in data set returns the same item for the same index each time it is read (renders and
    crops are seeded by the index; no random augmentation). Keyed by (side, index); float32, on the device. Data
    that carries latents itself (``latents_<side>``, e.g. DDSPO pairs) passes through. `enabled` is False for a data
    set whose latents would need more than `max_bytes` (then every batch is encoded as it comes).
    """

    def __init__(self, num_items: int, latent_numel: int, *, enabled: bool = True, max_bytes: int = 2 * 1024**3):
        self.estimate = 2 * num_items * latent_numel * 4  # both sides, float32
        self.enabled = enabled and self.estimate <= max_bytes
        self._store: dict[tuple[str, int], torch.Tensor] = {}

    def latents(self, policy, batch_data: dict, side: str, indices: list[int], device) -> torch.Tensor:
        """`data_latents` of one side of a batch whose items are `indices`, encoding only items not seen before."""
        if not self.enabled or f"latents_{side}" in batch_data:
            return data_latents(policy, batch_data, side, device)
        missing = [k for k, i in enumerate(indices) if (side, i) not in self._store]
        if missing:
            images = batch_data[f"images_{side}"][missing]
            for k, latent in zip(missing, policy.encode_images(images.to(device))):
                self._store[side, indices[k]] = latent
        return torch.stack([self._store[side, i] for i in indices])


def build_lr_scheduler(optimizer, warmup_steps: int, max_steps: int, kind: str):
    """``constant_with_warmup`` or ``cosine`` (with linear warmup), stepped once per optimizer step."""
    if kind not in ("constant_with_warmup", "cosine"):
        raise ValueError(f"trainer.lr_scheduler must be 'constant_with_warmup' or 'cosine', got {kind!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant_with_warmup":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(cfg: DictConfig) -> dict:
    """Runs a preference fine-tuning job described by `cfg` (see ``configs/train.yaml``); returns the final metrics.

    Raises:
        ValueError: when the selected method's ``data_flow`` is neither "pairs" nor "winners", when a "pairs" method
            gets data without losers, or when the data's image size is not the model's pixel size.
        NonFiniteError: after ``trainer.max_consecutive_nonfinite`` skipped updates in a row (checkpoint saved).
        TrainingInterrupted: on SIGTERM / SIGINT, after a checkpoint is saved between two updates.
    """
    with run_lock(cfg.output_dir, "diffalign-train"), StopSignals() as stop:
        results = _train(cfg, stop)
        stop.raise_if_received("at the end", f"the run finished; its results are in {cfg.output_dir}")
        return results


def _train(cfg: DictConfig, stop: StopSignals) -> dict:
    # ------------------------------------------------------------------------------------------------------------------
    # 1. setup: accelerator, seeds, policy, objective, data, optimizer
    # ------------------------------------------------------------------------------------------------------------------
    t_start = time.time()
    output_dir = Path(cfg.output_dir)
    tr = cfg.trainer
    log_with = None if tr.log_with in (None, "none") else tr.log_with
    accelerator = Accelerator(
        gradient_accumulation_steps=tr.gradient_accumulation_steps,
        mixed_precision=tr.mixed_precision,
        log_with=log_with,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        cpu=tr.cpu,
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, whatever the number of processes
    )
    set_seed(cfg.seed)
    objective = instantiate(cfg.method)
    data_flow = getattr(objective, "data_flow", None)
    if data_flow not in ("pairs", "winners"):
        raise ValueError(f"method={cfg.method._target_} consumes {data_flow!r} data; the preference loop runs methods "
                         "whose data_flow is 'pairs' or 'winners'")
    policy = instantiate(cfg.model)
    policy.to(accelerator.device)
    reference = instantiate(cfg.reference)
    reference.setup(policy)  # adds the reference adapter (if any) before the optimizer collects trainable parameters
    if callable(getattr(objective, "setup", None)):  # e.g. DDSPO's DD-CPP target adapters, for the same reason
        objective.setup(policy)
    latent_h, latent_w = policy.latent_shape[1:]
    pixel_size = (latent_h * policy.vae_scale_factor, latent_w * policy.vae_scale_factor)
    data_kwargs = {}
    if "resolution" in cfg.data and cfg.data.resolution is None:
        if pixel_size[0] != pixel_size[1]:
            raise ValueError(f"the model's images are {pixel_size[0]}x{pixel_size[1]} px; set data.resolution")
        data_kwargs["resolution"] = pixel_size[0]
    dataset = instantiate(cfg.data, **data_kwargs)
    # every reward call is checked (RewardError names reward, step, batch, prompt; nothing becomes 0 silently)
    rewards = checked_rewards(build_selected_rewards(cfg.reward))
    eval_rewards = checked_rewards(build_selected_rewards(cfg.eval_reward)) if cfg.get("eval_reward") else rewards
    monitor = build_monitor(cfg.get("monitor"), eval_rewards, samples_dir=output_dir / "logs" / "samples")
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=tr.learning_rate, betas=(tr.adam_beta1, tr.adam_beta2),
                                  weight_decay=tr.adam_weight_decay, eps=tr.adam_epsilon)
    lr_scheduler = build_lr_scheduler(optimizer, tr.lr_warmup_steps, tr.max_steps, tr.lr_scheduler)
    wrapped, optimizer, lr_scheduler = accelerator.prepare(policy.denoiser, optimizer, lr_scheduler)
    if wrapped is not policy.denoiser:  # DDP/FSDP: forward through the wrapper, switch adapters on the bare module
        policy.set_forward_module(wrapped)
    guard = NonFiniteGuard(tr.get("max_consecutive_nonfinite", 5))
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        accelerator.init_trackers("diffalign", config=_flat_hparams(cfg) if log_with == "tensorboard" else
                                  OmegaConf.to_container(cfg, resolve=True))

    def write_lora_and_reference(directory: Path) -> None:
        policy.save_lora_weights(directory)
        write_state(reference.state_dict(), directory, "reference_state")

    def write_checkpoint(step: int) -> Path:
        return save_checkpoint(
            output_dir, step, lora_dir_writer=write_lora_and_reference, optimizer=optimizer,
            lr_scheduler=lr_scheduler, keep_last=tr.keep_last, lineage=lineage,
            state={"global_step": step, "epoch": sampler.state_dict()["epoch"] if sampler is not None else 0,
                   "sampler": sampler.state_dict() if sampler is not None else None,  # None: stopped while preparing
                   "nonfinite": guard.state_dict()},
        )

    def checkpoint_before_stop(step: int) -> Path | None:
        """The checkpoint of `step` (written now unless it exists) when a reward fails; main process only."""
        existing = output_dir / f"checkpoint-{step}"
        if not accelerator.is_main_process:
            return None
        return existing if existing.exists() else write_checkpoint(step)

    def stop_with_checkpoint(step: int) -> Path:
        """`checkpoint_before_stop` on the main process, then a barrier (the others wait for the write to finish)."""
        ckpt = checkpoint_before_stop(step)
        accelerator.wait_for_everyone()
        return ckpt if ckpt is not None else output_dir / f"checkpoint-{step}"

    sampler = None
    lineage = new_lineage()  # keep_last prunes only this lineage's checkpoints; a resumed run carries its lineage on
    data_seconds = 0.0
    if callable(getattr(dataset, "prepare", None)):  # on-policy data (e.g. RankedPairs) is made by the policy itself
        t_data = time.time()
        set_reward_step(rewards, 0)
        with stop_on_reward_error(lambda: checkpoint_before_stop(0), log=accelerator.print):
            prepare_dataset(dataset, policy, rewards, cfg=cfg, accelerator=accelerator, stop=stop)
        data_seconds = time.time() - t_data
        accelerator.print(f"[diffalign] data prepared in {data_seconds:.0f}s: {getattr(dataset, 'stats', {})}")
    # one global batch of batch_size × processes per micro-step; process r takes its r-th slice (no duplicates)
    num_proc, rank = accelerator.num_processes, accelerator.process_index
    if len(dataset) < tr.batch_size * num_proc:  # on-policy data only knows its size now (static data: validation)
        raise ValueError(f"the data holds {len(dataset)} items, fewer than one global batch (trainer.batch_size="
                         f"{tr.batch_size} × {num_proc} processes); lower trainer.batch_size or make more data "
                         "(e.g. raise data.num_prompts or data.samples_per_prompt)")
    sampler = ResumableSampler(len(dataset), tr.batch_size * num_proc, seed=cfg.seed, shuffle=True, drop_last=True)
    latent_cache = LatentCache(len(dataset), math.prod(policy.latent_shape), enabled=tr.get("cache_latents", True))
    if tr.get("cache_latents", True) and not latent_cache.enabled:
        accelerator.print(f"[diffalign] the data's latents would take {latent_cache.estimate / 1024**3:.1f} GiB; "
                          "encoding every batch as it comes instead of caching (trainer.cache_latents)")
    n_trainable = sum(p.numel() for p in params)
    effective = tr.batch_size * tr.gradient_accumulation_steps * accelerator.num_processes
    unit = "pairs" if data_flow == "pairs" else "winners"
    accelerator.print(f"[diffalign] {n_trainable / 1e6:.3f}M trainable parameters; {tr.max_steps} optimizer steps × "
                      f"{effective} {unit} (batch {tr.batch_size} × accumulation {tr.gradient_accumulation_steps} × "
                      f"{accelerator.num_processes} processes); {len(dataset)} items; reference "
                      f"{reference.strategy}; output {output_dir}")

    # ------------------------------------------------------------------------------------------------------------------
    # 2. resume
    # ------------------------------------------------------------------------------------------------------------------
    global_step = 0
    if accelerator.is_main_process:  # half-written checkpoints of a killed run (never picked by resume)
        remove_temporaries(output_dir)
    if cfg.resume is not None:
        ckpt = latest_checkpoint(output_dir) if cfg.resume == "latest" else Path(cfg.resume)
        if ckpt is None:
            accelerator.print(f"[diffalign] resume=latest: no checkpoint in {output_dir}, starting from scratch")
        else:
            state = load_checkpoint(ckpt, optimizer=optimizer, lr_scheduler=lr_scheduler)
            policy.load_lora_weights(ckpt)
            global_step = state["global_step"]
            lineage = state.get("lineage") or lineage
            if state["sampler"] is not None:  # (None: a run stopped by a reward failure while preparing data)
                sampler.load_state_dict(state["sampler"])
            reference.load_state_dict(read_state(ckpt, "reference_state"))
            guard.load_state_dict(state.get("nonfinite", guard.state_dict()))
            accelerator.print(f"[diffalign] resumed from {ckpt} at step {global_step}")

    # ------------------------------------------------------------------------------------------------------------------
    # 3. train
    # ------------------------------------------------------------------------------------------------------------------
    policy.denoiser.train()
    progress = tqdm(total=tr.max_steps, initial=global_step, desc="train", disable=not accelerator.is_main_process)
    history = []
    t_train = time.time()
    if monitor is not None and global_step == 0 and accelerator.is_main_process:  # the baseline of the monitors
        with stop_on_reward_error(lambda: checkpoint_before_stop(0), log=accelerator.print), bare_forward(policy):
            monitor.maybe_log(0, policy, accelerator, log=accelerator.print)
    while global_step < tr.max_steps:
        if stop.requested(accelerator):  # SIGTERM / SIGINT: checkpoint, then exit (code 128 + signal in the CLI)
            ckpt = stop_with_checkpoint(global_step)
            accelerator.print(f"[diffalign] {stop.name} received: stopped at step {global_step}, checkpoint {ckpt}; "
                              "continue with resume=latest")
            raise TrainingInterrupted(f"stopped by {stop.name} at step {global_step}; checkpoint saved to {ckpt}; "
                                      "continue with resume=latest", stop.signum, checkpoint=ckpt)
        sums: dict[str, float] = {}
        loss_finite = True
        reference.on_step(policy, global_step)
        for micro in range(tr.gradient_accumulation_steps):
            indices = sampler.next_batch()[rank * tr.batch_size:(rank + 1) * tr.batch_size]
            batch_data = dataset.collate(indices)
            if "latents_w" in batch_data:
                if tuple(batch_data["latents_w"].shape[1:]) != tuple(policy.latent_shape):
                    raise ValueError(f"data latents are {tuple(batch_data['latents_w'].shape[1:])} but the model's are "
                                     f"{tuple(policy.latent_shape)}; generate the pairs with this model")
            elif tuple(batch_data["images_w"].shape[-2:]) != pixel_size:
                raise ValueError(f"data images are {tuple(batch_data['images_w'].shape[-2:])} px but the model makes "
                                 f"{pixel_size} px images; set data.resolution={pixel_size[0]} (or null)")
            if data_flow == "pairs" and "images_l" not in batch_data and "latents_l" not in batch_data:
                raise ValueError(f"method={cfg.method._target_} needs preference pairs but data={cfg.data._target_} "
                                 "yields winners only; pick a pairs data set (e.g. data=shapes_pairs, data=pickapic)")
            with torch.no_grad():
                latents_w = latent_cache.latents(policy, batch_data, "w", indices, accelerator.device)
                embeds = policy.encode_prompts(batch_data["prompts"], do_classifier_free_guidance=False)
                if data_flow == "pairs":
                    latents_l = latent_cache.latents(policy, batch_data, "l", indices, accelerator.device)
                    degraded = batch_data.get("degraded_prompts")
                    degraded_embeds = (None if degraded is None else
                                       policy.encode_prompts(degraded, do_classifier_free_guidance=False))
            if data_flow == "pairs":
                batch = PreferenceBatch(latents_w, latents_l, batch_data["prompts"], embeds, batch_data["ids"],
                                        degraded_prompts=degraded, degraded_prompt_embeds=degraded_embeds)
            else:
                batch = WinnerBatch(latents_w, batch_data["prompts"], embeds, batch_data["ids"])
            with accelerator.accumulate(policy.forward_module), accelerator.autocast():
                # one generator per sample, keyed by its position in the global batch (`sample_generators`)
                generators = sample_generators(cfg.seed, global_step, micro, rank * tr.batch_size,
                                               len(batch_data["prompts"]))
                loss, metrics = objective(policy, batch, generator=generators, reference=reference)
                loss_finite = loss_finite and bool(torch.isfinite(loss))
                accelerator.backward(loss)  # also when non-finite: every process must take part in the all-reduce
            for k, v in metrics.items():
                if torch.is_tensor(v) and v.numel() == 1:
                    sums[k] = sums.get(k, 0.0) + float(v) / tr.gradient_accumulation_steps
        # a non-finite loss or gradient (on any process) skips the update; the step still counts (data, LR schedule)
        if guard.update_ok(accelerator, params, tr.max_grad_norm, loss_finite):
            optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1
        sums["nonfinite_skips"] = guard.skips
        sums["lr"] = lr_scheduler.get_last_lr()[0]
        if guard.exhausted:
            ckpt = stop_with_checkpoint(global_step)
            raise NonFiniteError(
                f"{guard.consecutive} updates in a row had a non-finite loss or gradient (step {global_step}, "
                f"trainer.max_consecutive_nonfinite={guard.max_consecutive}); checkpoint saved to {ckpt}. Lower "
                "trainer.learning_rate or method.beta, set trainer.max_grad_norm, or use trainer.mixed_precision=no, "
                "then resume with resume=latest", checkpoint=ckpt)
        history.append({"step": global_step, **sums})
        accelerator.log(sums, step=global_step)
        if monitor is not None and accelerator.is_main_process:  # gold reward + diversity every monitor.every steps
            with stop_on_reward_error(lambda step=global_step: checkpoint_before_stop(step), log=accelerator.print), \
                    bare_forward(policy):
                monitor.maybe_log(global_step, policy, accelerator, log=accelerator.print)
        progress.update(1)
        progress.set_postfix(loss=f"{sums.get('loss', float('nan')):.4f}", acc=f"{sums.get('implicit_acc', 0):.2f}")
        if tr.checkpointing_steps and global_step % tr.checkpointing_steps == 0 and accelerator.is_main_process:
            write_checkpoint(global_step)
    progress.close()
    train_seconds = time.time() - t_train
    if accelerator.is_main_process and not (output_dir / f"checkpoint-{global_step}").exists():
        write_checkpoint(global_step)  # (a resumed run that was already finished has it)
    final_dir = output_dir / "final"
    if accelerator.is_main_process:
        policy.save_lora_weights(final_dir)

    # ------------------------------------------------------------------------------------------------------------------
    # 4. evaluate base vs fine-tuned; the HTML report (<output_dir>/eval/report.html)
    # ------------------------------------------------------------------------------------------------------------------
    results = {"global_step": global_step, "train_seconds": train_seconds, "data_seconds": data_seconds,
               "data_stats": getattr(dataset, "stats", {}), "final_lora": str(final_dir),
               "history_tail": history[-5:]}
    if cfg.eval.enabled and accelerator.is_main_process:
        t_eval = time.time()
        policy.denoiser.eval()
        ecfg = eval_config_from(cfg.eval)
        rows = select_prompts(load_prompts(ecfg.prompts), ecfg.prompts_per_tag)
        set_reward_step(eval_rewards, global_step, reset_calls=True)
        with stop_on_reward_error(lambda: checkpoint_before_stop(global_step), log=accelerator.print), \
                bare_forward(policy):
            results["eval"] = evaluate_policy(policy, rows, eval_rewards, ecfg, output_dir / "eval",
                                              {"base": True, "finetuned": False}, log=accelerator.print,
                                              base_key=base_reuse_key(cfg.model, cfg.get("eval_reward") or cfg.reward))
        results["eval_seconds"] = time.time() - t_eval
        results["report"] = str(write_report(output_dir / "eval", run_dir=output_dir))
        accelerator.print(f"[diffalign] report: {results['report']}")
    results["total_seconds"] = time.time() - t_start
    if accelerator.is_main_process:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        accelerator.print(f"[diffalign] done in {results['total_seconds']:.0f}s; results in {output_dir}")
    accelerator.end_training()
    return results
