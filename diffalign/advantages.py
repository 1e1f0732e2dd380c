"""Group-relative advantages (GRPO, Flow-GRPO, DGPO) and DDPO's per-prompt running statistics
(docs/methods/algorithms.md#group-advantages).

For a prompt c with group rewards r_1..r_G:  A_i = (r_i − mean_c) / (std + ε), with the std of the group
(``std="group"``, DGPO GenEval) or of the whole batch (``std="global"``, every Flow-GRPO task config), then clipped to
[−clip, clip] (5 in all released code). A group whose rewards are all equal has A ≡ 0 (its numerator is exactly 0);
the fraction of such groups is reported, since those prompts teach nothing (Flow-GRPO logs it).

The std is sqrt(Σ (r − mean)² / (n − correction)): the released code differs in both the correction and ε —

| released code | std | ε | here |
|---|---|---|---|
| flow_grpo / DGPO `flow_grpo/stat_tracking.py` | `np.std`, population (n) | 1e-4 | ``correction=0, eps=1e-4`` |
| DanceGRPO / ViPO `train_vipo_*.py` | `torch.Tensor.std()`, sample (n − 1) | 1e-8 | ``correction=1, eps=1e-8`` |
| ddpo-pytorch `stat_tracking.py` (`PerPromptStatTracker`) | `np.std`, population | 1e-6 | the tracker's `eps` |

DDPO (Black et al., arXiv:2305.13301; ddpo-pytorch `PerPromptStatTracker`) normalises with per-prompt running
statistics over the last `buffer_size` rewards of that prompt, falling back to the batch's statistics until a prompt has
`min_count` rewards.
"""

from __future__ import annotations

from collections import deque

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    std: str = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
    correction: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalised advantages.

    Args:
        rewards (`torch.Tensor`): `(N,)` rewards.
        group_ids (`torch.Tensor`): `(N,)` int group of each sample (any integers; a group may have any size ≥ 1,
            > `correction` with ``std="group"``).
        std (`str`, defaults to "group"): "group" (each group's std), "global" (the batch's std) or "none"
            (centring only).
        eps (`float`, defaults to 1e-4): added to the std (flow_grpo 1e-4, ViPO 1e-8).
        clip (`float`, *optional*, defaults to 5): clip A to [−clip, clip]; `None` disables clipping.
        correction (`int`, defaults to 0): the std's divisor is n − correction: 0 the population std (`np.std`,
            flow_grpo), 1 the sample std (`torch.Tensor.std()`, DanceGRPO/ViPO).

    Returns:
        (`(N,)` float32 advantages, stats ``{"zero_std_fraction", "reward_mean", "reward_std"}``; ``reward_std`` is
        the batch's population std whatever `correction`).

    Raises:
        ValueError: for mismatched shapes, a non-finite reward, an unknown `std` or `correction`, or a group (batch,
            with ``std="global"``) of at most `correction` samples.
    """
    if std not in ("group", "global", "none"):
        raise ValueError(f"online.advantage_std must be 'group', 'global' or 'none', got {std!r}.")
    if correction not in (0, 1):
        raise ValueError(f"online.advantage_std_correction={correction!r} must be 0 (population std, flow_grpo) or 1 "
                         "(sample std, DanceGRPO/ViPO).")
    # float64 statistics: the float32 rewards sum exactly there (n < 2**29), so the mean of equal rewards is that
    # reward and their A is exactly 0; in float32 a group of 7 rewards of 0.7 centred to 6e-8, which the 1e-8 of
    # DanceGRPO/ViPO turned into A = +0.8 for every member (tests/unit/test_constant_rewards.py)
    rewards = rewards.detach().float().reshape(-1).double()
    group_ids = torch.as_tensor(group_ids).reshape(-1)
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must match.")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN/inf; fix the reward (diffalign never replaces them silently).")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    means = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, rewards) / counts
    centred = rewards - means[inverse]
    if std == "group":
        if (counts <= correction).any():
            raise ValueError(f"a group of {int(counts.min())} reward(s) has no sample std (online.advantage_std_correction"
                             f"={correction}); use groups of at least 2 (online.group_size) or correction 0.")
        squares = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, centred**2)
        var = squares / (counts - correction)
        advantages = centred / (var.sqrt()[inverse] + eps)
    elif std == "global":
        if len(rewards) <= correction:
            raise ValueError(f"{len(rewards)} reward(s) have no sample std (online.advantage_std_correction="
                             f"{correction}).")
        advantages = centred / (rewards.std(correction=correction) + eps)
    else:
        advantages = centred
    advantages = advantages.float()
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    zero = (torch.zeros(len(uniq)).index_add_(0, inverse, (centred != 0).float()) == 0).float()
    stats = {"zero_std_fraction": float(zero.mean()), "reward_mean": float(rewards.mean()),
             "reward_std": float(rewards.std(unbiased=False))}
    return advantages, stats


class PerPromptStatTracker:
    """DDPO's per-prompt running reward statistics.

    Args:
        buffer_size (`int`, defaults to 16): rewards kept per prompt (DDPO: 16–32).
        min_count (`int`, defaults to 16): below this many stored rewards a prompt uses the batch's mean/std.
        eps (`float`, defaults to 1e-6): added to the std.
        clip (`float`, *optional*, defaults to 5): advantage clip.
    """

    def __init__(self, buffer_size: int = 16, min_count: int = 16, eps: float = 1e-6, clip: float | None = 5.0):
        if buffer_size < 1 or min_count < 1:
            raise ValueError("`buffer_size` and `min_count` must be >= 1.")
        self.buffer_size, self.min_count, self.eps, self.clip = buffer_size, min_count, eps, clip
        self.buffers: dict[str, deque] = {}

    def update(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Adds the batch's rewards to each prompt's buffer, then returns `(N,)` float32 advantages
        (r − mean_prompt) / (std_prompt + eps), clipped; prompts with fewer than `min_count` rewards use the batch's
        mean and std."""
        rewards = rewards.detach().float().reshape(-1).double()  # (float64 statistics: see group_advantages)
        if len(prompts) != len(rewards):
            raise ValueError(f"{len(prompts)} prompts for {len(rewards)} rewards.")
        if not torch.isfinite(rewards).all():
            raise ValueError("rewards contain NaN/inf; fix the reward (diffalign never replaces them silently).")
        out = torch.empty_like(rewards)
        for prompt in dict.fromkeys(prompts):
            idx = torch.tensor([i for i, p in enumerate(prompts) if p == prompt])
            buf = self.buffers.setdefault(prompt, deque(maxlen=self.buffer_size))
            buf.extend(rewards[idx].tolist())
            if len(buf) < self.min_count:
                mean, std = rewards.mean(), rewards.std(unbiased=False)
            else:
                stored = torch.tensor(list(buf), dtype=torch.float64)
                mean, std = stored.mean(), stored.std(unbiased=False)
            out[idx] = (rewards[idx] - mean) / (std + self.eps)
        out = out.float()
        return out.clamp(-self.clip, self.clip) if self.clip is not None else out

    def state_dict(self) -> dict:
        """JSON-serialisable state (the buffers), for checkpoints."""
        return {"buffers": {p: list(b) for p, b in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {p: deque(v, maxlen=self.buffer_size) for p, v in state.get("buffers", {}).items()}


def best_of_n_rows(rewards: torch.Tensor, group_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The rows kept by DanceGRPO/ViPO's best-of-N selection: in every group, the n/2 highest and the n/2 lowest
    rewards (docs/methods/algorithms.md#dancegrpo, docs/methods/algorithms.md#vipo); the others are not trained on.
    Ties are broken by row order (stable sort). With n ≥ the group size every row is kept (the released scripts' G = N
    = 8 is a no-op).

    Args:
        rewards (`torch.Tensor`): `(N,)` rewards.
        group_ids (`torch.Tensor`): `(N,)` group of each row.
        n (`int`): N, even, ≥ 2.

    Returns:
        `(M,)` int64 row indices in increasing order.

    Raises:
        ValueError: for an odd or non-positive `n`, or mismatched shapes.
    """
    if n < 2 or n % 2:
        raise ValueError(f"online.best_of_n={n} must be an even number >= 2 (n/2 best and n/2 worst per group)")
    rewards = rewards.detach().float().reshape(-1).cpu()
    group_ids = torch.as_tensor(group_ids).reshape(-1).cpu()
    if rewards.shape != group_ids.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must match.")
    keep = []
    for g in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == g).flatten()
        if len(rows) <= n:
            keep.append(rows)
            continue
        order = rows[torch.argsort(rewards[rows], stable=True)]
        keep.append(torch.cat([order[:n // 2], order[-(n // 2):]]))
    return torch.cat(keep).sort().values


ADVANTAGE_KINDS = ("group", "per_prompt", "per_reward")
"""The advantages an online method may ask for (its ``advantage``; `EpochAdvantages`)."""


class EpochAdvantages:
    """The advantages of an online epoch, of the kind the method asks for (`ADVANTAGE_KINDS`).

    - "group": `group_advantages` of the weighted reward sum;
    - "per_prompt": DDPO's `PerPromptStatTracker` (its state is this object's `state_dict`);
    - "per_reward": `group_advantages` of each reward's own scores, one column per reward.

    Args:
        kind (`str`): one of the kinds above.
        std (`str`): `group_advantages`' ``std`` (``online.advantage_std``).
        clip (`float`, *optional*): `group_advantages`' ``clip`` (``online.advantage_clip``); also the tracker's.
        correction (`int`): `group_advantages`' ``correction`` (``online.advantage_std_correction``).
        eps (`float`): `group_advantages`' ``eps`` (``online.advantage_eps``).
        tracker_buffer_size (`int`): the tracker's buffer size (``online.tracker_buffer_size``).
        tracker_min_count (`int`): the tracker's minimum count (``online.tracker_min_count``).

    Raises:
        ValueError: for an unknown `kind` (naming the method's ``advantage``).
    """

    def __init__(self, kind: str, *, std: str = "group", clip: float | None = 5.0, correction: int = 0,
                 eps: float = 1e-4, tracker_buffer_size: int = 16, tracker_min_count: int = 16):
        if kind not in ADVANTAGE_KINDS:
            raise ValueError(f"the method's advantage={kind!r} must be one of {ADVANTAGE_KINDS}")
        self.kind = kind
        self.options = {"std": std, "clip": clip, "correction": correction, "eps": eps}
        self.tracker = (PerPromptStatTracker(tracker_buffer_size, tracker_min_count, clip=clip)
                        if kind == "per_prompt" else None)

    def __call__(self, scores: torch.Tensor, group_ids: torch.Tensor, prompts: list[str],
                 components) -> tuple[torch.Tensor, dict[str, float]]:
        """Advantages of every row of the epoch (all processes' rows, in rank order).

        Args:
            scores (`torch.Tensor`): `(N,)` the weighted reward sums.
            group_ids (`torch.Tensor`): `(N,)` group id of each row.
            prompts (`list[str]`): the `N` prompts.
            components (`Callable[[], torch.Tensor]`): returns the `(N, R)` per-reward scores; called for
                "per_reward" only.

        Returns:
            (`(N,)` or, for "per_reward", `(N, R)` float32 advantages; stats ``{"zero_std_fraction"}``: for
            "per_reward" the first reward's).
        """
        if self.kind == "per_prompt":
            return self.tracker.update(prompts, scores), {
                "zero_std_fraction": group_advantages(scores, group_ids)[1]["zero_std_fraction"]}
        if self.kind == "per_reward":
            per_reward = components()
            columns = [group_advantages(per_reward[:, j], group_ids, **self.options)
                       for j in range(per_reward.shape[1])]
            return torch.stack([c[0] for c in columns], 1), {"zero_std_fraction": columns[0][1]["zero_std_fraction"]}
        return group_advantages(scores, group_ids, **self.options)

    def state_dict(self) -> dict:
        """The tracker's state ("per_prompt"), else empty."""
        return self.tracker.state_dict() if self.tracker is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.tracker is not None:
            self.tracker.load_state_dict(state)
