"""Group rollouts for online methods: G samples per prompt, with initial noise shared inside a group or not.

DGPO draws independent initial noises for the G samples of a prompt; DanceGRPO/ViPO start all G from the same noise
(`init_same_noise`); Flow-GRPO and DDPO draw independently (docs/methods/algorithms.md#dancegrpo,
docs/methods/algorithms.md#dgpo). Noise is never shared across groups or across processes: every random stream is
seeded from ``(seed, epoch, global group index[, member])`` through `numpy.random.SeedSequence`, and each process owns
distinct global group indices. The same seed therefore reproduces the same rollouts bit for bit; another chunking
(`rollout_batch_size`) draws the same noise and differs only by the float rounding of batched forwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffalign.methods import stream_seed
from diffalign.models.base import DiffusionPolicy
from diffalign.samplers.base import Sampler
from diffalign.types import PromptEmbeds, Trajectory

# stream tags keep the initial-noise and per-step-noise streams of one sample apart
_INIT, _STEP = 0, 1


def group_initial_noise(shape: tuple[int, ...], group_indices: list[int], group_size: int, *, seed: int, epoch: int,
                        shared: bool, device: torch.device | str = "cpu", members: list[int] | None = None
                        ) -> torch.Tensor:
    """Initial noise for `len(group_indices)` groups of `group_size` samples, rows ``[g0]*G + [g1]*G + ...`` (or only
    the member indices `members` of each group, when a group spans processes).

    Args:
        shape (`tuple`): one sample's latent shape `(C, h, w)`.
        group_indices (`list[int]`): global group indices (distinct across processes).
        group_size (`int`): G ≥ 1.
        seed (`int`): the run's seed.
        epoch (`int`): the epoch.
        shared (`bool`): True gives all G members of a group the same noise (GRPO/DanceGRPO); False independent ones.
        members (`list[int]`, *optional*): the member indices (in ``0..G-1``) to draw for every group; default all.

    Returns:
        `(len(group_indices)·len(members), *shape)` float32 on `device`.
    """
    rows = []
    for g in group_indices:
        for m in (range(group_size) if members is None else members):
            gen = torch.Generator().manual_seed(stream_seed(seed, epoch, g, 0 if shared else m, _INIT))
            rows.append(torch.randn(shape, generator=gen))
    return torch.stack(rows).to(device)


def cat_trajectories(trajectories: list[Trajectory]) -> Trajectory:
    """Concatenates rollouts of the same schedule along the batch."""
    first = trajectories[0]
    pe = [t.prompt_embeds for t in trajectories]
    cat = lambda name: None if getattr(pe[0], name) is None else torch.cat([getattr(e, name) for e in pe])
    return Trajectory(
        latents=torch.cat([t.latents for t in trajectories]),
        timesteps=first.timesteps,
        log_probs=torch.cat([t.log_probs for t in trajectories]),
        trainable=first.trainable,
        prompt_embeds=PromptEmbeds(cat("prompt_embeds"), cat("negative_prompt_embeds"), cat("pooled_prompt_embeds"),
                                   cat("negative_pooled_prompt_embeds")),
        images=None if first.images is None else torch.cat([t.images for t in trajectories]),
        prompts=[p for t in trajectories for p in t.prompts],
        guidance_scale=first.guidance_scale,
        noise=first.noise,
        sigmas=first.sigmas,
        sampler=first.sampler,
    )


def group_rollout(
    policy: DiffusionPolicy,
    prompts: list[str],
    group_size: int,
    *,
    sampler: Sampler,
    group_indices: list[int],
    seed: int,
    epoch: int,
    shared_initial_noise: bool = False,
    rollout_batch_size: int = 32,
    reduction: str = "mean",
    members: list[int] | None = None,
    on_chunk: Callable[[Trajectory, int, int], None] | None = None,
    encode_prompts_once: bool = False,
    fuse_lora: bool | str = "auto",
) -> tuple[Trajectory, torch.Tensor]:
    """Samples `group_size` images for each prompt (no gradients).

    Args:
        policy (`DiffusionPolicy`): the rollout policy (θ, or θ⁻ swapped in by the caller).
        prompts (`list[str]`): `P` prompts, one per group.
        group_size (`int`): G ≥ 1.
        sampler (`Sampler`): the rollout sampler (`diffalign.samplers.base.build_sampler` of ``cfg.sampler``), of
            the policy's family; ``sampler.at_epoch(epoch)`` samples (MixGRPO's window moves with the epoch).
        group_indices (`list[int]`): `P` global group indices (seed the noise; distinct across processes).
        seed (`int`): the run's seed.
        epoch (`int`): the epoch.
        shared_initial_noise (`bool`): one initial noise per group (GRPO/DanceGRPO) instead of one per sample (DGPO).
        rollout_batch_size (`int`): images per forward batch (the noise does not depend on it).
        reduction (`str`): log-prob reduction of a stochastic sampler ("mean", "sum", or "per_position" for ViPO).
        members (`list[int]`, *optional*): sample only these member indices of every group (a group spanning several
            processes: each samples its share; a member's noise depends only on (seed, epoch, group, member)).
        on_chunk (*optional*): called as ``on_chunk(part, start, stop)`` after each forward batch with its
            `Trajectory` (rows ``start:stop`` of the result), e.g. to send it to a reward server while the next one is
            sampled (`diffalign.rewards.reward_set.ChunkScorer`).
        encode_prompts_once (`bool`): encode the `P` prompts (and their negatives "" with guidance) once and give
            each row its prompt's embeddings, instead of encoding every row's prompt in each forward batch (P·G rows).
            Faster, but not bit for bit: the text encoders' matmuls round differently at another batch size, so the
            embeddings differ by ~1e-7 (tiny SD3 at 2 vs 8 rows; docs/results/performance.md).
        fuse_lora (`bool` or `"auto"`): fold a trained LoRA adapter into the denoiser's weights for each forward
            batch (`Sampler.sample`'s `fuse_lora`, `diffalign.models.base.inference_lora`): the bare denoiser's cost
            instead of the unfused LoRA branch's, but not bit for bit (the weights are summed before the matmul, so
            the samples differ by float rounding; docs/results/performance.md). ``"auto"`` (default) folds for a
            deterministic sampler (``not sampler.stochastic``: an ODE rollout, which stores no log-probs, so nothing
            has to equal an update's recompute) and never for a stochastic one, whose stored log-probs must equal the
            update's recompute exactly; True / False: always / never. An all-zero adapter is skipped either way.

    Returns:
        (`Trajectory` with `P·G` rows ``[p0]*G + [p1]*G + ...`` (`P·len(members)` with `members`), `group_ids` int64
        global group indices, one per row).

    Raises:
        ValueError: for `group_size < 1`, mismatched `group_indices`, a `fuse_lora` other than True, False or
            "auto", or a sampler of the other model family (`Sampler.fits`).
    """
    if group_size < 1:
        raise ValueError(f"`group_size` must be >= 1, got {group_size}.")
    if not (isinstance(fuse_lora, bool) or fuse_lora == "auto"):
        raise ValueError(f"`fuse_lora` must be True, False or 'auto', got {fuse_lora!r}.")
    if len(group_indices) != len(prompts):
        raise ValueError(f"{len(group_indices)} group indices for {len(prompts)} prompts; pass one per prompt.")
    sampler.fits(policy)
    sampler = sampler.at_epoch(epoch)
    if fuse_lora == "auto":  # no stored log-probs, nothing to equal a recompute: fold the adapter
        fuse_lora = not sampler.stochastic
    member_ids = list(range(group_size)) if members is None else list(members)
    if any(not 0 <= m < group_size for m in member_ids):
        raise ValueError(f"members {member_ids} must lie in [0, {group_size}).")
    noise = group_initial_noise(policy.latent_shape, list(group_indices), group_size, seed=seed, epoch=epoch,
                                shared=shared_initial_noise, device=policy.device, members=member_ids)
    all_prompts = [p for p in prompts for _ in member_ids]
    members = [(g, m) for g in group_indices for m in member_ids]
    embeds = None
    if encode_prompts_once:  # P prompts encoded once; the rows of a group share their prompt's embeddings
        with torch.no_grad():
            embeds = policy.encode_prompts(list(prompts), do_classifier_free_guidance=sampler.guidance_scale > 1)
    prompt_rows = [i for i in range(len(prompts)) for _ in member_ids]
    parts = []
    for start in range(0, len(all_prompts), rollout_batch_size):
        stop = min(start + rollout_batch_size, len(all_prompts))
        # per-step noise streams (an ODE solver draws none: its only noise is the initial one)
        gens = [torch.Generator(device=policy.device).manual_seed(stream_seed(seed, epoch, g, m, _STEP))
                for g, m in members[start:stop]]
        parts.append(sampler.sample(policy, all_prompts[start:stop], generator=gens, latents=noise[start:stop],
                                    prompt_embeds=None if embeds is None else embeds.index(prompt_rows[start:stop]),
                                    reduction=reduction, **({"fuse_lora": True} if fuse_lora else {})))
        if on_chunk is not None:
            on_chunk(parts[-1], start, stop)
    group_ids = torch.tensor([g for g, _ in members], dtype=torch.long)
    return cat_trajectories(parts), group_ids
