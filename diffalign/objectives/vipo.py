r"""ViPO — Visual Preference Policy Optimization (Ni et al., CVPR 2026, arXiv:2511.18719),
docs/methods/algorithms.md#vipo.

GRPO whose scalar group advantage A_i is redistributed over latent positions p (space, and time for video) by a
perceptual allocation map M_i ∈ [0, 1] (`diffalign.vipo.psm.PerceptualStructuring`, built once per epoch from the
decoded rollouts):

$$A_i^p=\operatorname{clip}(M_i(p)\,A_i,\pm5),\qquad
\mathcal L=\operatorname{mean}_{i,p}\max\big(-A_i^p\rho^p_{ik},\,-A_i^p\operatorname{clip}(\rho^p_{ik},1\pm\epsilon_c)\big),$$

with ρ^p the *local* likelihood ratio of the stochastic step at position p: the Gaussian log-density summed over the
latent channels only (``reduction="per_position"``; the rollout stores `(B, K, *grid)` log-probs). No KL and no
reference in the released code (β = 0, as DanceGRPO); ``beta_kl`` > 0 adds Flow-GRPO's KL to the frozen base,
+ β_KL · mean_i mean_elements (μθ − μref)² / (2 s²) (`diffalign.objectives.policy_gradient.kl_to_reference`), a
diffalign option for runs whose updates alone cost the verifier (docs/results/video.md).

With ``advantage_per_reward`` (the Wan script with the VideoAlign VQ and MQ rewards)
each selected reward gets its own group advantage and map, and the loss is Σ_r c_r 𝓛(A_r·M) with c_r the reward's
``weight`` (1.0 each in the released script). ``reduction="scalar_weighted"`` reproduces the released FLUX script, which
mean-reduces the log-prob to one scalar per sample: its per-pixel loss is plain GRPO with A_i replaced by
mean_p clip(M_i(p) A_i, ±5) (the max/clip commutes with M ≥ 0) — with an all-ones map it *is* GRPO.

The online loop calls `prepare` (`prepare_epoch(policy, trajectory, advantages)`) once per epoch, before any update (it
decodes nothing twice: the maps are computed from `trajectory.images`), then `loss`, which calls the objective with
``rows=`` the minibatch's row indices into that epoch's trajectory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from diffalign.config.schemas import config_schema
from diffalign.methods import CurrentPolicy, OnlineEpoch, method_config
from diffalign.objectives.policy_gradient import (
    LOGPROB_TOLERANCE,
    TIMESTEP_SELECTIONS,
    StoredTransitionMethod,
    TransitionUnit,
    kl_to_reference,
    transition_plan,
)
from diffalign.samplers.rollout import recompute_step
from diffalign.types import Trajectory
from diffalign.vipo.backbones import check_backbone_spec
from diffalign.vipo.psm import PerceptualStructuring, advantage_maps, check_psm_options

REDUCTIONS = ("per_position", "scalar_weighted")
MAPS = ("psm", "ones")
KL_FORMS = ("code", "exact")


@config_schema("method", "vipo")
@dataclass
class ViPOConfig:
    """Config of `ViPO` (``method=vipo`` extends it); the one place its defaults are written (the method is built from
    it: `diffalign.methods.method_config`). [CODE] = the released scripts (train_vipo_flux.py / train_vipo_wan_fsdp.py),
    [PAPER] = arXiv:2511.18719."""

    _target_: str = "diffalign.objectives.vipo.ViPO"
    clip_range: float = 1.0e-4          # [CODE]
    reduction: str = "per_position"     # per_position (paper, Wan script) | scalar_weighted (released FLUX script)
    timestep_fraction: float = 0.6      # 60% of the transitions [CODE]
    detach_unconditional: bool = True   # unconditional CFG branch under no-grad (Wan script)
    advantage_clip: float | None = 5.0  # A^p clipped to +-5 [CODE]
    map: str = "psm"                    # psm | ones (all-ones map: the ablation; with scalar_weighted it is GRPO exactly)
    backbone: str = "tiny_clip"         # tiny_clip | dinov2:<local folder> (paper: DINOv2-large) | python:<module>:<factory>
    num_components: int = 3             # K [PAPER: K = 3 best balance]
    aggregation: str = "weighted"       # weighted (released code) | average | first
    orientation: str = "reverse"        # reverse (released code: (max - z)/(max - min)) | forward
    spatial_sigma: float = 1.0          # Gaussian on the patch grid [PAPER: sigma = 1]
    temporal_sigma: float = 0.3         # video: Gaussian along latent frames [CODE]
    advantage_per_reward: bool = False  # true: one advantage (and map) per selected reward, sum_r weight_r L_r (Wan)
    timestep_selection: str = "random"  # random: one random 60% for the batch | per_sample: one per sample [CODE] | first
    smoothing_padding: str = "reflect"  # scipy.ndimage.gaussian_filter's mode 'reflect' [CODE] | replicate (earlier)
    smoothing_truncate: float = 4.0     # kernel radius int(truncate * sigma + 0.5): scipy's default [CODE] | 3 earlier
    beta_kl: float = 0.0                # KL to the frozen base: none in the released code [CODE]; > 0 is Flow-GRPO's
    kl_form: str = "code"               # that KL's std: code (Flow-GRPO's released form) | exact (the step std)
    logprob_check: str = "stop"         # train/rollout consistency alarm (epoch's first update): stop|warn|off
    logprob_tolerance: float = LOGPROB_TOLERANCE  # max |recomputed - stored| log-prob (docs/guides/reliability.md)


class ViPO(StoredTransitionMethod):
    """ViPO (data flow "online_trajectories": DanceGRPO-style rollouts with stored per-position log-probs).

    Built from `ViPOConfig`, the one place its defaults are written: ``ViPO(config)`` or ``ViPO(**fields)`` (the fields
    not given keep their `ViPOConfig` defaults; `diffalign.methods.method_config`).

    Fields:
        clip_range (`float`): ε_c of the per-position clipped ratio (released code: 1e-4).
        reduction (`str`): "per_position" (paper form; Wan script) or "scalar_weighted" (released FLUX script).
        timestep_fraction (`float`): fraction of each rollout's transitions trained per epoch.
        timestep_selection (`str`): "random" (a random subset, one draw for the whole batch),
            "first" (`diffalign.objectives.policy_gradient.train_transitions`) or "per_sample" (one random subset per
            rollout, as the released scripts: `diffalign.objectives.policy_gradient.per_sample_transitions`).
        detach_unconditional (`bool`): the unconditional CFG branch under no-grad (Wan script).
        advantage_clip (`float`): clip of A_i^p.
        map (`str`): "psm" (the Perceptual Structuring Module) or "ones" (all-ones maps: the ablation / GRPO).
        advantage_per_reward (`bool`): one group advantage per selected reward (normalised
            separately) and the loss Σ_r c_r 𝓛_r with c_r = ``reward.<name>.weight`` (set by `prepare` as
            `reward_coefficients`); False uses the advantage of the weighted reward sum.
        backbone (`str` or object): "tiny_clip", "dinov2:<folder>", "python:<module>:<factory>", or a backbone
            object with ``patch_tokens``.
        num_components (`int`): the PSM's K (`diffalign.vipo.psm.PerceptualStructuring`, as each
            PSM option below; paper: K = 3).
        aggregation (`str`): the PSM's aggregation of its components (paper: weighted).
        orientation (`str`): the PSM's normalisation of each component.
        spatial_sigma (`float`): the PSM's spatial Gaussian σ (paper: σ = 1).
        temporal_sigma (`float`): the PSM's temporal Gaussian σ (video; paper: 0.3).
        smoothing_padding (`str`): the smoothings' border handling (released code:
            `scipy.ndimage.gaussian_filter`, i.e. "reflect").
        smoothing_truncate (`float`): the smoothings' kernel radius in σ (scipy's default 4).
        beta_kl (`float`): weight of the KL to the reference (0: none, the released code); added once per loss, for
            every reward's term together.
        kl_form (`str`): "code" or "exact", as Flow-GRPO's (`diffalign.objectives.policy_gradient.kl_to_reference`).
        logprob_check (`str`): the train/rollout consistency alarm
            (`diffalign.objectives.policy_gradient.StoredTransitionMethod`): "stop", "warn" or "off".
        logprob_tolerance (`float`): its tolerance on |Δ log π| (per position here).

    Raises:
        ValueError: for a non-positive clip range, an unknown reduction/map/timestep selection/aggregation/
            orientation/smoothing padding/backbone form/KL form, a fraction outside (0, 1], a non-positive truncate or
            advantage clip, fewer than 1 component, a negative smoothing sigma or a negative β_KL.
    """

    data_flow = "online_trajectories"
    rollout_sampler_kind = "sde"
    advantage = "group"  # (per instance: "per_reward" with advantage_per_reward)
    rollout_policy = CurrentPolicy()  # on-policy: θ samples the epoch

    def __init__(self, config: ViPOConfig | None = None, **fields):
        config = method_config(ViPOConfig, config, fields)
        self.init_logprob_check(config.logprob_check, config.logprob_tolerance)
        if config.clip_range <= 0:
            raise ValueError(f"method.clip_range={config.clip_range} must be > 0 (1e-4 in the released ViPO code).")
        if config.reduction not in REDUCTIONS:
            raise ValueError(f"method.reduction={config.reduction!r} must be one of {REDUCTIONS}.")
        if config.map not in MAPS:
            raise ValueError(f"method.map={config.map!r} must be one of {MAPS}.")
        if not 0 < config.timestep_fraction <= 1:
            raise ValueError(f"method.timestep_fraction={config.timestep_fraction} must be in (0, 1].")
        if config.timestep_selection not in TIMESTEP_SELECTIONS:
            raise ValueError(f"method.timestep_selection={config.timestep_selection!r} must be one of "
                             f"{TIMESTEP_SELECTIONS}.")
        check_psm_options(config.aggregation, config.orientation, config.num_components, config.smoothing_padding,
                          config.smoothing_truncate)
        if config.spatial_sigma < 0 or config.temporal_sigma < 0:
            raise ValueError(f"method.spatial_sigma={config.spatial_sigma} and method.temporal_sigma="
                             f"{config.temporal_sigma} must be >= 0 (0: no smoothing).")
        if config.advantage_clip is not None and config.advantage_clip <= 0:
            raise ValueError(f"method.advantage_clip={config.advantage_clip} must be > 0 (5 in the released code) or "
                             "null.")
        if config.beta_kl < 0:
            raise ValueError(f"method.beta_kl={config.beta_kl} must be >= 0 (0: no KL, the released ViPO code).")
        if config.kl_form not in KL_FORMS:
            raise ValueError(f"method.kl_form={config.kl_form!r} must be one of {KL_FORMS}.")
        if config.map == "psm" and isinstance(config.backbone, str):
            check_backbone_spec(config.backbone)  # (the backbone itself loads at the first epoch)
        self.clip_range, self.reduction = config.clip_range, config.reduction
        self.timestep_fraction, self.timestep_selection = config.timestep_fraction, config.timestep_selection
        self.detach_unconditional = config.detach_unconditional
        self.advantage_clip, self.map = config.advantage_clip, config.map
        self.beta_kl, self.kl_form = config.beta_kl, config.kl_form
        self._psm_args = {name: getattr(config, name) for name in (
            "backbone", "num_components", "aggregation", "orientation", "spatial_sigma", "temporal_sigma",
            "smoothing_padding", "smoothing_truncate")}
        self._psm: PerceptualStructuring | None = None
        self.maps: torch.Tensor | None = None
        self.advantage_maps: torch.Tensor | None = None
        self.map_stats: dict[str, float] = {}
        self.advantage_per_reward = config.advantage_per_reward
        # what the loop computes (`OnlineMethod`)
        self.advantage = "per_reward" if config.advantage_per_reward else "group"
        self.reward_coefficients: torch.Tensor | None = None  # (R,) c_r, set by `prepare` with advantage_per_reward

    @property
    def log_prob_reduction(self) -> str:
        """The log-prob reduction the rollouts must store: "per_position" (`(B, K, *grid)`) or "mean"."""
        return "per_position" if self.reduction == "per_position" else "mean"

    def prepare(self, policy, epoch: OnlineEpoch) -> dict[str, float]:
        """`prepare_epoch` on the epoch's rollouts and advantages (with ``advantage_per_reward``, the reward weights
        become `reward_coefficients` first); returns the map statistics as ``vipo/<name>``."""
        if self.advantage_per_reward:  # c_r of Σ_r c_r 𝓛_r: the rewards' weights
            self.reward_coefficients = epoch.reward_weights
        return {f"vipo/{k}": v for k, v in self.prepare_epoch(policy, epoch.trajectory, epoch.advantages).items()}

    def plan(self, policy, epoch: OnlineEpoch) -> Iterator[list[TransitionUnit]]:
        """The epoch's updates, as the other policy-gradient methods (`transition_plan`), the first one checked for
        train/rollout consistency (`StoredTransitionMethod.checked_updates`)."""
        return self.checked_updates(epoch, transition_plan(epoch, self.timestep_fraction, self.timestep_selection))

    def loss(self, policy, unit: TransitionUnit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one unit, with the advantage maps `prepare` built for its rows, times ``unit.weight`` (the
        metrics unscaled; `diffalign.objectives.policy_gradient.TransitionUnit`)."""
        mb = unit.epoch.trajectory.index(unit.rows)
        loss, metrics = self(policy, mb, unit.epoch.advantages[unit.rows].to(mb.latents.device), unit.k,
                             reference=reference, rows=unit.rows)
        return unit.weighted(loss), metrics

    @property
    def psm(self) -> PerceptualStructuring:
        if self._psm is None:
            self._psm = PerceptualStructuring(**self._psm_args)
        return self._psm

    def compute_maps(self, policy, trajectory: Trajectory) -> torch.Tensor:
        """M_i on the latent grid (`policy.latent_shape[1:]`) for every rollout of `trajectory`, `(B, *grid)`."""
        grid = tuple(trajectory.latents.shape[3:])
        if self.map == "ones":
            self.map_stats = {"map_mean": 1.0, "map_fallback": 0.0}
            return torch.ones((len(trajectory.prompts), *grid))
        images = trajectory.images
        if images is None:
            with torch.no_grad():
                images = policy.decode(trajectory.latents[:, -1])
        maps, info = self.psm(images, grid)
        self.map_stats = {"map_mean": info["map_mean"], "map_fallback": float(info["fallback"].float().mean())}
        return maps

    def prepare_epoch(self, policy, trajectory: Trajectory, advantages: torch.Tensor) -> dict[str, float]:
        """Builds this epoch's maps and advantage maps A_i^p (called by the online loop before the updates)."""
        self.maps = self.compute_maps(policy, trajectory)
        self.advantage_maps = advantage_maps(self.maps, advantages, self.advantage_clip)
        return dict(self.map_stats)

    def __call__(self, policy, trajectory: Trajectory, advantages: torch.Tensor, k: int, *, reference=None,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of transition `k` of every rollout in the minibatch `trajectory`.

        Args:
            trajectory (`Trajectory`): rows `rows` of the epoch's trajectory; `log_probs` `(B, K, *grid)` for
                "per_position", `(B, K)` for "scalar_weighted".
            advantages (`torch.Tensor`): `(B,)` scalar group advantages A_i, or `(B, R)` one per reward (with
                `reward_coefficients` c_r; the loss is Σ_r c_r 𝓛_r).
            k (`int`): the transition index.
            rows (`torch.Tensor`, *optional*): the minibatch's row indices into the trajectory given to
                `prepare_epoch`; without it (or before `prepare_epoch`) the maps are computed for this minibatch.

        Returns:
            (scalar loss, detached metrics ``loss, ratio, clipfrac, approx_kl, adv_map_abs``, and ``kl`` when
            ``beta_kl`` > 0).

        Raises:
            ValueError: when ``beta_kl`` > 0 and `reference` is None, or the maps and log-probs do not match.
        """
        if rows is not None and self.advantage_maps is not None:
            adv_map = self.advantage_maps[torch.as_tensor(rows).cpu()]
        else:
            adv_map = advantage_maps(self.compute_maps(policy, trajectory), advantages, self.advantage_clip)
        step = recompute_step(policy, trajectory, k, reduction=self.log_prob_reduction,
                              detach_unconditional=self.detach_unconditional)
        device = step.log_prob.device
        old = trajectory.log_probs[:, k].to(device)
        self.check_logprobs(step.log_prob, old, k)
        # (B, R, *grid) per reward vs (B, *grid); the latents are (B, K + 1, C, *grid)
        per_reward = adv_map.ndim == trajectory.latents.ndim - 1
        columns = [adv_map[:, r] for r in range(adv_map.shape[1])] if per_reward else [adv_map]
        if per_reward and (self.reward_coefficients is None or len(self.reward_coefficients) != len(columns)):
            raise ValueError(f"{len(columns)} per-reward advantages need {len(columns)} reward_coefficients; the "
                             "training loop sets them from reward.<name>.weight")
        ratio = torch.exp(step.log_prob - old)
        loss = torch.zeros((), device=device)
        for r, column in enumerate(columns):
            if self.reduction == "scalar_weighted":
                # mean over positions in float64, so an all-ones map gives back A_i bit for bit (test: equals GRPO)
                adv = column.to(device).double().reshape(len(column), -1).mean(dim=1).float()
            else:
                adv = column.to(device).float()
                if tuple(old.shape) != tuple(adv.shape):
                    raise ValueError(f"per-position log-probs {tuple(old.shape)} do not match the advantage maps "
                                     f"{tuple(adv.shape)}; the rollout must use reduction='per_position'.")
            unclipped = -adv * ratio
            clipped = -adv * ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
            term = torch.maximum(unclipped, clipped).mean()
            loss = loss + (float(self.reward_coefficients[r]) * term if per_reward else term)
        kl = None
        if self.beta_kl > 0:
            kl = kl_to_reference(policy, trajectory, k, step, reference, self.kl_form)
            loss = loss + self.beta_kl * kl
        metrics = {
            "loss": loss.detach(),
            "ratio": ratio.detach().mean(),
            "clipfrac": ((ratio.detach() - 1).abs() > self.clip_range).float().mean(),
            "approx_kl": (0.5 * (step.log_prob.detach() - old) ** 2).mean(),
            "adv_map_abs": adv_map.abs().mean(),
            **({"kl": kl.detach()} if kl is not None else {}),
        }
        return loss, metrics
