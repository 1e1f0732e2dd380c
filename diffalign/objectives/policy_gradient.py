r"""The clipped policy-gradient surrogate over stored denoising transitions, shared by DDPO and Flow-GRPO.

Per stored transition k of rollout i (ALGORITHMS.md §2.2(a), §2.3(a)):

$$\rho_{ik}=\exp(\log\pi_\theta(x_{k+1}\mid x_k,c)-\log\pi_{old}),\qquad
\mathcal L=\operatorname{mean}_{i}\max\big(-A_i\rho_{ik},\,-A_i\operatorname{clip}(\rho_{ik},1-\epsilon_c,1+\epsilon_c)\big)
+\beta_{KL}\,\operatorname{mean}_i D_{KL}\big(\pi_\theta(\cdot\mid x_k)\,\|\,\pi_{ref}(\cdot\mid x_k)\big)$$

(PPO, Schulman et al., arXiv:1707.06347, eq. 7, as DDPO eq. 5 and Flow-GRPO eq. 8 use it), with the Gaussian step
policies of ALGORITHMS.md §1.3 whose std does not depend on θ. The KL between two Gaussians of the same std s is
‖μ_θ − μ_ref‖² / (2 s²); the released Flow-GRPO code divides the *mean* squared difference by 2σ_t² where σ_t is the
SDE's noise scale without the √|Δ| factor (`kl_form="code"`, the default, Δ absorbed in β); `kl_form="exact"` uses the
step std s.

Which stored transitions an inner epoch trains is `train_transitions` (``timestep_selection``): the first
⌊K · timestep_fraction⌋ in order, as the released Flow-GRPO loop, or a random subset of that size shared by every
rollout.
"""

from __future__ import annotations

import math

import torch

from diffalign.samplers.rollout import recompute_step
from diffalign.types import Trajectory

TIMESTEP_SELECTIONS = ("first", "random")


def train_transitions(num_steps: int, timestep_fraction: float, selection: str,
                      generator: torch.Generator | None = None) -> list[int]:
    """The stored transitions trained in one inner epoch (the same for every rollout), in increasing order.

    Their number is n = max(1, ⌊K · timestep_fraction⌋), the released loops' ``int(num_steps * timestep_fraction)``
    (ddpo-pytorch and flow_grpo ``scripts/train*.py``; at least one here).

    - ``"first"``: transitions 0 … n − 1 of the time-ordered trajectory (flow_grpo ``scripts/train_sd3.py``: ``for j in
      range(num_train_timesteps)`` over ``sample["timesteps"][:, j]``, which it never permutes), so the last K − n
      transitions, the low-noise end, are never trained: with K = 10 and 0.99, transitions 0 … 8.
    - ``"random"``: the first n of a permutation of 0 … K − 1 drawn from `generator`, sorted; one draw for all rollouts
      (diffalign's alternative). ddpo-pytorch and DanceGRPO/ViPO draw one permutation *per sample* instead
      (``torch.randperm`` per sample, then the first n): with timestep_fraction 1 every transition is trained either
      way; below 1 the per-sample draw is not implemented.

    Args:
        num_steps (`int`): K, the stored transitions per rollout (≥ 1).
        timestep_fraction (`float`): in (0, 1].
        selection (`str`): "first" or "random".
        generator (`torch.Generator`, *optional*): the stream of the "random" draw.

    Returns:
        `list[int]` of n distinct indices in [0, K), increasing.

    Raises:
        ValueError: for an unknown `selection` (naming ``method.timestep_selection``) or a fraction outside (0, 1].
    """
    if selection not in TIMESTEP_SELECTIONS:
        raise ValueError(f"method.timestep_selection={selection!r} must be one of {TIMESTEP_SELECTIONS}.")
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"method.timestep_fraction={timestep_fraction} must be in (0, 1].")
    n_train = max(1, math.floor(num_steps * timestep_fraction))
    if selection == "first":
        return list(range(n_train))
    return torch.randperm(num_steps, generator=generator)[:n_train].sort().values.tolist()


class ClippedPolicyGradient:
    """PPO-clip over stored transitions (data flow "online_trajectories").

    Args:
        clip_range (`float`, defaults to 1e-4): ε_c (DDPO and Flow-GRPO: 1e-4, tuned for mean-reduced log-probs).
        beta_kl (`float`, defaults to 0.0): KL weight to the reference (Flow-GRPO: 0.04 GenEval; DDPO: 0).
        kl_form (`str`, defaults to "code"): "code" or "exact" (see the module docstring).
        detach_unconditional (`bool`): stop gradients through the unconditional CFG branch when recomputing.
        advantage (`str`): how the loop normalises rewards: "group" (GRPO) or "per_prompt" (DDPO's stat tracker).
        timestep_fraction (`float`, defaults to 1.0): fraction of each rollout's transitions trained per epoch.
        timestep_selection (`str`, defaults to "random"): which of them, "first" or "random" (`train_transitions`).

    Raises:
        ValueError: for a non-positive clip range, negative β_KL, an unknown `kl_form`/`advantage`/
            `timestep_selection`, or a fraction outside (0, 1].
    """

    data_flow = "online_trajectories"
    rollout_sampler_kind = "sde"

    def __init__(self, clip_range: float = 1e-4, beta_kl: float = 0.0, kl_form: str = "code",
                 detach_unconditional: bool = False, advantage: str = "group", timestep_fraction: float = 1.0,
                 timestep_selection: str = "random"):
        if clip_range <= 0:
            raise ValueError(f"method.clip_range={clip_range} must be > 0 (1e-4 in DDPO/Flow-GRPO).")
        if beta_kl < 0:
            raise ValueError(f"method.beta_kl={beta_kl} must be >= 0.")
        if kl_form not in ("code", "exact"):
            raise ValueError(f"method.kl_form={kl_form!r} must be 'code' or 'exact'.")
        if advantage not in ("group", "per_prompt"):
            raise ValueError(f"method.advantage={advantage!r} must be 'group' or 'per_prompt'.")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"method.timestep_fraction={timestep_fraction} must be in (0, 1].")
        if timestep_selection not in TIMESTEP_SELECTIONS:
            raise ValueError(f"method.timestep_selection={timestep_selection!r} must be one of {TIMESTEP_SELECTIONS}.")
        self.clip_range, self.beta_kl, self.kl_form = clip_range, beta_kl, kl_form
        self.detach_unconditional, self.advantage = detach_unconditional, advantage
        self.timestep_fraction, self.timestep_selection = timestep_fraction, timestep_selection

    def __call__(self, policy, trajectory: Trajectory, advantages: torch.Tensor, k: int, *, reference=None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of transition `k` of every rollout in `trajectory` (a minibatch).

        Args:
            policy: the policy θ.
            trajectory (`Trajectory`): `B` stochastic rollouts with stored `log_probs` `(B, K)` (θ_old's).
            advantages (`torch.Tensor`): `(B,)` advantages.
            k (`int`): the transition index.
            reference: a reference strategy (`use(policy)` context), needed when `beta_kl > 0`.

        Returns:
            (scalar loss, detached metrics ``loss, ratio, clipfrac, approx_kl, kl``).
        """
        step = recompute_step(policy, trajectory, k, detach_unconditional=self.detach_unconditional)
        old = trajectory.log_probs[:, k].to(step.log_prob.device)
        adv = advantages.to(step.log_prob.device).float()
        ratio = torch.exp(step.log_prob - old)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
        loss = torch.maximum(unclipped, clipped).mean()
        kl = torch.zeros((), device=loss.device)
        if self.beta_kl > 0:
            if reference is None:
                raise ValueError("method.beta_kl > 0 needs a reference; the loop passed none.")
            with torch.no_grad(), reference.use(policy):
                ref = recompute_step(policy, trajectory, k)
            std = torch.as_tensor(step.std, device=loss.device).float()
            if self.kl_form == "code" and trajectory.sampler in ("flow_sde", "dance_sde"):
                sig = trajectory.sigmas.to(loss.device)
                std = std / torch.sqrt(sig[k] - sig[k + 1])
            diff = (step.mean - ref.mean).float().pow(2).reshape(len(adv), -1).mean(dim=1)
            kl = (diff / (2 * std.reshape(-1) ** 2)).mean()
            loss = loss + self.beta_kl * kl
        metrics = {
            "loss": loss.detach(),
            "ratio": ratio.detach().mean(),
            "clipfrac": ((ratio.detach() - 1).abs() > self.clip_range).float().mean(),
            "approx_kl": (0.5 * (step.log_prob.detach() - old) ** 2).mean(),
            "kl": kl.detach(),
        }
        return loss, metrics
