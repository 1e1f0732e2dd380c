r"""DDSPO: Direct Diffusion Score Preference Optimization (Kim et al., [arXiv:2512.23426](https://arxiv.org/abs/2512.23426)).

docs/methods/algorithms.md#ddspo. Diffusion-DPO (docs/methods/algorithms.md#diffusion-dpo) regresses winner and loser
on the forward-process noise ε. DDSPO keeps its loss but takes the targets of every denoising transition from a
*contrastive policy pair* (CPP): a winning-policy score for the winner and a losing-policy score for the loser,

$$m_w=\ell(f_\theta(x^w_t,t,c),\,\epsilon^w_\star),\quad m_l=\ell(f_\theta(x^l_t,t,c),\,\epsilon^l_\star),\quad
r_w=\ell(f_{ref}(x^w_t,t,c),\,\epsilon^w_\star),\quad r_l=\ell(f_{ref}(x^l_t,t,c),\,\epsilon^l_\star),$$
$$\mathcal L=\operatorname{mean}_{\text{pairs}}\ \omega_t\,\big[-\log\sigma\big(-\tfrac\beta2[(m_w-r_w)-(m_l-r_l)]\big)\big]$$

with ℓ the per-sample mean squared error (docs/methods/algorithms.md#denoising-loss), one t and one ε shared by the
pair, and the policy and reference always conditioned on the original prompt c. CPP instantiations (``cpp=``):

=======  ==================================  ============================================================
``cpp``  ε^w_⋆                               ε^l_⋆
=======  ==================================  ============================================================
``tf``   f_ref(x^w_t, t, c)                  f_ref(x^l_t, t, c⁻), c⁻ the degraded prompt; no CFG (TF-CPP)
``dd``   f_φw(x^w_t, t, c)                   f_φl(x^l_t, t, c); φ^w/φ^l LoRAs fine-tuned on preferred /
                                             dispreferred images (DD-CPP, ``diffalign-ddcpp-targets``)
``off``  the `training_target` (ε, v, u)     the same (Diffusion-DPO exactly)
=======  ==================================  ============================================================

Under TF-CPP ``r_w ≡ 0`` (the winner's target is the reference's own output). Sources: the project page (method,
tables) and the authors' code (``ddspo/dpo.py``, ``ddspo/adapters/{sd,sd3}.py``, ``ddspo/data.py``) as summarised in
docs/methods/algorithms.md#ddspo; the β/2 prefactor and the per-sample mean are the Diffusion-DPO code's
(arXiv:2311.12908 Eq. 14).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from diffalign.config.schemas import config_schema
from diffalign.data.degrade import random_word_removal
from diffalign.methods import method_config
from diffalign.objectives.common import (
    Generators,
    check_timestep_range,
    draw_timesteps_and_noise,
    per_sample_mse,
    rand,
    randint,
)
from diffalign.objectives.diffusion_dpo import diffusion_dpo_loss
from diffalign.types import PreferenceBatch, PromptEmbeds

if TYPE_CHECKING:
    from diffalign.models.base import DiffusionPolicy

logger = logging.getLogger(__name__)

CPP_MODES = ("tf", "dd", "off")
LOSS_WEIGHTINGS = ("uniform", "linear")
PREDICTION_SPACES = ("native", "x0")
RAND_COND_SCHEDULES = ("sigmoid", "exponential", "constant")
TARGET_ADAPTERS = ("ddcpp_winner", "ddcpp_loser")
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def ddspo_loss(
    model_losses_w: torch.Tensor,
    model_losses_l: torch.Tensor,
    ref_losses_w: torch.Tensor,
    ref_losses_l: torch.Tensor,
    beta: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    r"""DDSPO loss from per-sample losses against the CPP targets (docs/methods/algorithms.md#ddspo; authors'
    ``ddspo/dpo.py``).

    $$z=-\tfrac\beta2\big[(m_w-r_w)-(m_l-r_l)\big],\qquad \mathcal L=\operatorname{mean}_b\ \omega_b\,(-\log\sigma(z_b)).$$

    Without `weights` this is `diffusion_dpo_loss` itself (same value and metrics); with policy = reference the loss
    is ``ln 2`` (times the mean weight).

    Args:
        model_losses_w (`torch.Tensor` of shape `(B,)`): m_w ≥ 0 (carries the gradient).
        model_losses_l (`torch.Tensor` of shape `(B,)`): m_l ≥ 0 (carries the gradient).
        ref_losses_w (`torch.Tensor` of shape `(B,)`): r_w ≥ 0.
        ref_losses_l (`torch.Tensor` of shape `(B,)`): r_l ≥ 0.
        beta (`float`): β > 0 (SD1.x TF-CPP 16000, DD-CPP 8000, SD3/SANA 2000; docs/methods/algorithms.md#ddspo).
        weights (`torch.Tensor` of shape `(B,)`, *optional*): per-pair timestep weights ω_t ≥ 0 (e.g. ``t / (T-1)``,
            the "linear" weighting used for SDXL); `None` weights every pair 1.

    Returns:
        `tuple(torch.Tensor, dict[str, torch.Tensor])`: the scalar loss and the metrics of `diffusion_dpo_loss`
        (``loss`` is the weighted value).

    Raises:
        ValueError: as `diffusion_dpo_loss`, or if `weights` is not `(B,)`.
    """
    loss, metrics = diffusion_dpo_loss(model_losses_w, model_losses_l, ref_losses_w, ref_losses_l, beta=beta)
    if weights is None:
        return loss, metrics
    if weights.shape != model_losses_w.shape:
        raise ValueError(f"weights has shape {tuple(weights.shape)}; pass one weight per pair, shape "
                         f"{tuple(model_losses_w.shape)}.")
    z = -0.5 * beta * ((model_losses_w.float() - ref_losses_w.float()) - (model_losses_l.float() - ref_losses_l.float()))
    loss = (weights.float().to(z.device) * -F.logsigmoid(z)).mean()
    metrics["loss"] = loss.detach()
    return loss, metrics


def rand_cond_probability(timesteps: torch.Tensor, num_train_timesteps: int, schedule: str = "sigmoid",
                          lam: float = 20.0) -> torch.Tensor:
    r"""Probability that a pair's condition is replaced by an unpaired prompt (random-condition removal, authors'
    ``--rand_cond``; docs/methods/algorithms.md#ddspo), with ``s = t / T``:

    - "sigmoid": $\sigma(\lambda(s-0.7))$ (the default; λ = 20 in the authors' arguments);
    - "exponential": $e^{-\lambda(1-s)}$;
    - "constant": 1.

    Returns:
        `torch.Tensor` `(B,)` float32 in [0, 1].
    """
    s = timesteps.float() / num_train_timesteps
    if schedule == "sigmoid":
        return torch.sigmoid(lam * (s - 0.7))
    if schedule == "exponential":
        return torch.exp(-lam * (1 - s))
    if schedule == "constant":
        return torch.ones_like(s)
    raise ValueError(f"method.rand_cond_schedule={schedule!r} must be one of {list(RAND_COND_SCHEDULES)}.")


def _with_rows(embeds: PromptEmbeds, mask: torch.Tensor, new: PromptEmbeds) -> PromptEmbeds:
    """`embeds` with the rows where `mask` is True replaced, in order, by the rows of `new` (conditional and pooled
    embeddings; the negatives are not used by the unguided forwards and are dropped)."""
    def put(old, fresh):
        if old is None:
            return None
        out = old.clone()
        out[mask.to(old.device)] = fresh.to(old.device, old.dtype)
        return out

    return PromptEmbeds(put(embeds.prompt_embeds, new.prompt_embeds),
                        pooled_prompt_embeds=put(embeds.pooled_prompt_embeds, new.pooled_prompt_embeds))


class TargetPolicyAdapters:
    """DD-CPP's frozen target policies φ^w and φ^l: two extra peft LoRA adapters (``"ddcpp_winner"``,
    ``"ddcpp_loser"``) on the policy's UNet, loaded from diffusers LoRA folders (``pytorch_lora_weights.safetensors``,
    as `StableDiffusionPolicy.save_lora_weights` and ``diffalign-ddcpp-targets`` write them; any rank). They
    never require grad, are not in `policy.trainable_parameters()`, and are active only inside `use`.

    Args:
        policy (`StableDiffusionPolicy`): a LoRA policy whose adapter is named "default".
        paths (`dict[str, str]`): adapter name → folder.

    Raises:
        ValueError: if a folder has no weight file, naming the ``method.target_lora_*`` field.
    """

    def __init__(self, policy, paths: dict[str, str]):
        from peft.tuners.tuners_utils import BaseTunerLayer

        unet = policy.denoiser
        flags = {id(p): p.requires_grad for p in unet.parameters()}
        for name, path in paths.items():
            if not os.path.isfile(os.path.join(path, LORA_WEIGHT_NAME)):
                field = "method.target_lora_w" if name == TARGET_ADAPTERS[0] else "method.target_lora_l"
                raise ValueError(f"{field}={path!r} holds no {LORA_WEIGHT_NAME}; train the DD-CPP pair with "
                                 "diffalign-ddcpp-targets and point the field at its winner/ and loser/ folders")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # more adapters is the point
                unet.load_lora_adapter(path, prefix="unet", adapter_name=name, weight_name=LORA_WEIGHT_NAME)
        unet.set_adapter("default")
        self.params = [p for n, p in unet.named_parameters() if any(f".{a}." in n for a in paths)]
        for param in unet.parameters():
            param.requires_grad_(flags.get(id(param), False))
        self.flags = {id(p): p.requires_grad for p in unet.parameters()}
        self.unet = unet
        self.layers = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[None]:
        """Runs the UNet with adapter `name` only, in eval mode; the policy adapter, the train mode and every
        parameter's ``requires_grad`` are restored on exit (peft's ``set_adapter`` marks the active adapter
        trainable)."""
        was_training = self.unet.training

        def switch(adapter: str) -> None:
            for layer in self.layers:
                layer.set_adapter(adapter)
            for param in self.unet.parameters():
                param.requires_grad_(self.flags.get(id(param), False))

        switch(name)
        self.unet.eval()
        try:
            yield
        finally:
            switch("default")
            self.unet.train(was_training)


@config_schema("method", "ddspo")
@dataclass
class DDSPOConfig:
    """Config of `DDSPO`; the one place its defaults are written (the method is built from it:
    `diffalign.methods.method_config`)."""

    _target_: str = "diffalign.objectives.ddspo.DDSPO"
    beta: float = 16000.0
    cpp: str = "tf"
    loss_weighting: str = "uniform"
    prediction_space: str = "native"
    rand_cond: bool = False
    rand_cond_schedule: str = "sigmoid"
    rand_cond_lambda: float = 20.0
    rand_cond_prompts: str | None = None
    target_lora_w: str | None = None
    target_lora_l: str | None = None
    timestep_min: int = 0
    timestep_max: int | None = None


class DDSPO(nn.Module):
    r"""DDSPO objective (arXiv:2512.23426; docs/methods/algorithms.md#ddspo).

    One call, for a batch of ``B`` pairs ``(c, c⁻, x^w_0, x^l_0)``:

    1. draw ``t ~ U{timestep_min..timestep_max}`` and ``ε ~ N(0, I)`` per pair from `generator`, shared by winner and
       loser (`draw_timesteps_and_noise`, the same draws as `DiffusionDPO`);
    2. with ``rand_cond``: draw ``u ~ U(0, 1)`` per pair; where ``u < p(t)`` (`rand_cond_probability`) the pair's
       (c, c⁻) become an unpaired prompt and one of its degraded variants (from ``rand_cond_prompts``, or, when that is
       `None`, the pair ``(i + s) mod B`` of the same batch with ``s ~ U{1..B-1}`` drawn once per call), latents kept.
       Those pairs always get CPP targets (TF-CPP under ``cpp="off"``), as in the authors' data loader;
    3. noise ``[x^w_0; x^l_0]`` with `policy.add_noise`; run the policy unguided with gradient, and under
       ``torch.no_grad()`` the reference (``policy.reference()`` or ``reference.use(policy)``) on c and, for TF-CPP,
       on ``(x^l_t, c⁻)`` (3 frozen forwards of ``B`` rows; the winner target is the reference's own output on c), or
       φ^w/φ^l for DD-CPP;
    4. map every output and target to the prediction space, reduce with `per_sample_mse`, apply `ddspo_loss` with
       ω_t = 1 ("uniform") or ``t / (T - 1)`` ("linear").

    Prediction spaces: "native" is what `policy.predict` returns — ε for ε-prediction SD models (the paper's SD1.x /
    SDXL setting), v for v-prediction, the velocity v for flow models (SANA's setting; non-CPP target ``ε − x_0``).
    "x0" (flow models only, the paper's SD3 ``precondition_outputs``) compares ``x̂_0 = x_σ − σ v̂`` with σ = t / T
    (the flow policy is fed ``1000 σ``; docs/methods/algorithms.md#forward-processes), non-CPP target x_0. β does not
    transfer between spaces.

    Built from `DDSPOConfig`, the one place its defaults are written: ``DDSPO(config)`` or ``DDSPO(**fields)`` (the
    fields not given keep their `DDSPOConfig` defaults; `diffalign.methods.method_config`).

    Fields:
        beta (`float`): β > 0; the SD1.x TF-CPP value (docs/methods/algorithms.md#ddspo).
        cpp (`str`): "tf", "dd" or "off" (table in the module docstring).
        loss_weighting (`str`): "uniform" or "linear" (ω_t = t / (T-1), SDXL).
        prediction_space (`str`): "native" or "x0" (flow models only).
        rand_cond (`bool`): random-condition removal (step 2).
        rand_cond_schedule (`str`), rand_cond_lambda (`float`): p(t).
        rand_cond_prompts (`str`, *optional*): a prompt file (jsonl/txt) of unpaired prompts; rows with a
            ``"degraded_prompts"`` list use it, others get `random_word_removal` (seed 0); `None` uses the batch.
        target_lora_w (`str`, *optional*): DD-CPP's φ^w LoRA folder (required for "dd").
        target_lora_l (`str`, *optional*): DD-CPP's φ^l LoRA folder (required for "dd").
        timestep_min (`int`), timestep_max (`int`, *optional*): training timestep range, inclusive.

    Raises:
        ValueError: at construction, naming the ``method.*`` field, for β ≤ 0, an unknown mode, an empty timestep range,
            "dd" without both LoRA folders, or a `rand_cond_prompts` file with no usable prompt; at call time for
            missing degraded prompts, "x0" on a non-flow policy, "dd" before `setup`, or ``rand_cond`` from the batch
            with B < 2.
    """

    data_flow = "pairs"

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """TF-CPP (``method.cpp=tf``) and in-batch ``rand_cond`` read the pairs' degraded prompts c⁻: the data set's
        class must yield them (its ``degraded_prompts`` attribute, set by `diffalign.data.ddspo_pairs.DDSPOPairs`),
        checked before any model loads rather than at the first step.

        Raises:
            ValueError: naming ``method.cpp`` / ``method.rand_cond``, the data set and the fix.
        """
        from diffalign.config.checks import ConfigError, target_attribute

        method, data = cfg.get("method") or {}, cfg.get("data") or {}
        needs = method.get("cpp", "tf") == "tf" or (method.get("rand_cond", False)
                                                     and method.get("rand_cond_prompts") is None)
        target = data.get("_target_")
        if needs and target and not target_attribute(target, "degraded_prompts"):
            raise ConfigError(f"method=ddspo with method.cpp={method.get('cpp', 'tf')} needs the degraded prompts c⁻ of "
                              f"DDSPO pairs, but data={target.rsplit('.', 1)[-1]} has none; pass data=ddspo_pairs "
                              "data.pairs_dir=<folder> (made by diffalign-ddspo-pairs, or add data.generate=true), or "
                              "method.cpp=dd with its target LoRAs")

    def checkpoint_states(self) -> dict:
        """No state beyond the reference strategy's."""
        return {}

    def __init__(self, config: DDSPOConfig | None = None, **fields):
        config = method_config(DDSPOConfig, config, fields)
        super().__init__()
        if config.beta <= 0:
            raise ValueError(f"method.beta={config.beta} must be > 0; use e.g. method.beta=16000 (DDSPO SD1.x TF-CPP).")
        for field, value, allowed in (("cpp", config.cpp, CPP_MODES),
                                      ("loss_weighting", config.loss_weighting, LOSS_WEIGHTINGS),
                                      ("prediction_space", config.prediction_space, PREDICTION_SPACES),
                                      ("rand_cond_schedule", config.rand_cond_schedule, RAND_COND_SCHEDULES)):
            if value not in allowed:
                raise ValueError(f"method.{field}={value!r} must be one of {list(allowed)}.")
        if config.cpp == "dd" and not (config.target_lora_w and config.target_lora_l):
            raise ValueError("method.cpp=dd needs method.target_lora_w and method.target_lora_l (the winner/ and loser/"
                             " folders of diffalign-ddcpp-targets).")
        check_timestep_range(config)
        self.beta, self.cpp, self.loss_weighting = config.beta, config.cpp, config.loss_weighting
        self.prediction_space = config.prediction_space
        self.rand_cond, self.rand_cond_schedule = config.rand_cond, config.rand_cond_schedule
        self.rand_cond_lambda = config.rand_cond_lambda
        self.target_lora_w, self.target_lora_l = config.target_lora_w, config.target_lora_l
        self.timestep_min, self.timestep_max = config.timestep_min, config.timestep_max
        self.pool: list[tuple[str, list[str]]] | None = None
        if config.rand_cond and config.rand_cond_prompts is not None:
            self.pool = self._load_pool(config.rand_cond_prompts)
        self.targets: TargetPolicyAdapters | None = None

    @staticmethod
    def _load_pool(path: str) -> list[tuple[str, list[str]]]:
        from diffalign.world.prompts import load_prompts

        pool = []
        for row in load_prompts(path, field="method.rand_cond_prompts"):
            variants = row.get("degraded_prompts")
            if not variants:
                try:
                    variants = random_word_removal(row["prompt"], seed=0)
                except ValueError:
                    continue
            pool.append((row["prompt"], list(variants)))
        if not pool:
            raise ValueError(f"method.rand_cond_prompts={path!r} has no prompt that can be degraded.")
        return pool

    def extra_repr(self) -> str:
        return (f"beta={self.beta}, cpp={self.cpp!r}, loss_weighting={self.loss_weighting!r}, prediction_space="
                f"{self.prediction_space!r}, rand_cond={self.rand_cond}")

    def setup(self, policy: DiffusionPolicy) -> None:
        """Adds DD-CPP's target adapters to the policy (``cpp="dd"``; nothing otherwise). The training loop calls this
        once, before the optimizer collects the trainable parameters."""
        if self.cpp == "dd" and self.targets is None:
            self.targets = TargetPolicyAdapters(policy, {TARGET_ADAPTERS[0]: self.target_lora_w,
                                                         TARGET_ADAPTERS[1]: self.target_lora_l})

    def _to_space(self, policy, output: torch.Tensor, noisy: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        if self.prediction_space == "native":
            return output
        sigma = timesteps.float() / policy.scheduler.config.num_train_timesteps
        return noisy.float() - sigma.view(-1, *([1] * (noisy.ndim - 1))).to(noisy.device) * output

    def _unpaired_conditions(self, policy, batch: PreferenceBatch, mask: torch.Tensor, generator):
        """(c, c⁻) embeddings for the masked pairs: drawn from the pool, or another pair of the batch — the batch
        shifted by one s ∈ {1..B-1} with a single generator, or by a shift drawn per masked pair with per-sample
        generators (so two pairs may then share a partner)."""
        bsz = len(batch.prompts)
        n = int(mask.sum())
        per_sample = isinstance(generator, (list, tuple))
        masked = torch.arange(bsz)[mask.cpu()]
        gens = [generator[i] for i in masked.tolist()] if per_sample else generator
        if self.pool is None:
            if bsz < 2:
                raise ValueError("method.rand_cond draws the unpaired prompts from the batch, which needs "
                                 "trainer.batch_size >= 2; or set method.rand_cond_prompts to a prompt file.")
            # one shift for the batch, or one per masked pair with per-sample generators (in-batch partners depend on
            # the local batch either way; a pool, method.rand_cond_prompts, does not)
            shift = randint(1, bsz, n, gens).cpu() if per_sample else int(randint(1, bsz, 1, generator))
            src = (masked + shift) % bsz
            src = src.to(batch.prompt_embeds.prompt_embeds.device)
            return batch.prompt_embeds.index(src), batch.degraded_prompt_embeds.index(src)
        if per_sample:  # each masked pair draws its pick, then its variant, from its own generator
            draws = [(int(randint(0, len(self.pool), 1, g)), int(randint(0, 2**31, 1, g))) for g in gens]
            picks, variants = [a for a, _ in draws], [b for _, b in draws]
        else:
            picks = randint(0, len(self.pool), n, generator).tolist()
            variants = randint(0, 2**31, n, generator).tolist()
        prompts = [self.pool[i][0] for i in picks]
        degraded = [self.pool[i][1][v % len(self.pool[i][1])] for i, v in zip(picks, variants)]
        return (policy.encode_prompts(prompts, do_classifier_free_guidance=False),
                policy.encode_prompts(degraded, do_classifier_free_guidance=False))

    def forward(
        self,
        policy: DiffusionPolicy,
        batch: PreferenceBatch,
        generator: Generators = None,
        reference: Any = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Computes the DDSPO loss for a batch of pairs (steps in the class docstring).

        Args:
            policy (`DiffusionPolicy`): uses ``predict``, ``add_noise``, ``training_target``, ``reference()``,
                ``prediction_type``, ``scheduler.config.num_train_timesteps`` (and ``encode_prompts`` with a
                ``rand_cond_prompts`` pool).
            batch (`PreferenceBatch`): latents `(B, C, h, w)` (or any `(B, ...)` layout), `B` prompts and embeddings,
                and, for TF-CPP or in-batch ``rand_cond``, ``degraded_prompt_embeds`` (`B` rows).
            generator (`torch.Generator` or a list of `B`, *optional*): source of t, ε, then u and the unpaired-prompt
                draws; a list gives each pair its own (`diffalign.objectives.common.randn`).
            reference (*optional*): a reference strategy (`diffalign.reference`); `None` uses ``policy.reference()``.

        Returns:
            `tuple(torch.Tensor, dict[str, torch.Tensor])`: the loss (with gradient through the policy) and the
            metrics of `ddspo_loss` plus ``rand_cond_rate`` (fraction of pairs with a replaced condition).

        Raises:
            ValueError: see the class docstring; also for mismatched winner/loser shapes or embedding rows.
        """
        latents_w, latents_l = batch.latents_w, batch.latents_l
        if latents_w.shape != latents_l.shape:
            raise ValueError(f"batch.latents_w has shape {tuple(latents_w.shape)} but batch.latents_l has shape "
                             f"{tuple(latents_l.shape)}; winner and loser must have one shape.")
        bsz = latents_w.shape[0]
        if len(batch.prompt_embeds) != bsz:
            raise ValueError(f"batch.prompt_embeds has {len(batch.prompt_embeds)} rows for {bsz} pairs.")
        needs_degraded = self.cpp == "tf" or (self.rand_cond and self.pool is None)
        if needs_degraded and (batch.degraded_prompt_embeds is None or len(batch.degraded_prompt_embeds) != bsz):
            raise ValueError(f"method.cpp={self.cpp!r} (or rand_cond from the batch) needs the degraded prompts c⁻ of "
                             "the pairs (PreferenceBatch.degraded_prompt_embeds, B rows): train on DDSPO pairs "
                             "(data=ddspo_pairs), or use method.cpp=off / dd.")
        if self.prediction_space == "x0" and policy.prediction_type != "flow":
            raise ValueError(f"method.prediction_space=x0 is for flow models; this policy predicts "
                             f"{policy.prediction_type!r}: use method.prediction_space=native (ε-space for SD).")
        if self.cpp == "dd" and self.targets is None:
            raise ValueError("method.cpp=dd: call objective.setup(policy) first (the training loop does) to load the "
                             "target LoRAs.")
        num_train_timesteps = policy.scheduler.config.num_train_timesteps

        # 1. one (t, ε) per pair, repeated for the loser half: rows [w_0..w_{B-1}, l_0..l_{B-1}]
        timesteps, noise = draw_timesteps_and_noise(policy, tuple(latents_w.shape), self.timestep_min,
                                                    self.timestep_max, generator)
        # 2. random-condition removal
        cond, cond_minus = batch.prompt_embeds, batch.degraded_prompt_embeds
        mask = torch.zeros(bsz, dtype=torch.bool)
        if self.rand_cond:
            u = rand(bsz, generator)
            mask = (u < rand_cond_probability(timesteps, num_train_timesteps, self.rand_cond_schedule,
                                              self.rand_cond_lambda)).cpu()
            if mask.any():
                new_c, new_minus = self._unpaired_conditions(policy, batch, mask, generator)
                cond = _with_rows(cond, mask, new_c)
                # without batch c⁻ (cpp=off on other data) the unmasked rows' c⁻ is never used: c holds their place
                cond_minus = _with_rows(cond_minus if cond_minus is not None else cond, mask, new_minus)
        # 3. forwards on the shared noisy batch
        device = latents_w.device
        timesteps = timesteps.to(device)
        t2 = timesteps.repeat(2)
        noise = noise.to(device, latents_w.dtype).repeat(2, *([1] * (latents_w.ndim - 1)))
        latents = torch.cat([latents_w, latents_l])
        rows = torch.arange(bsz, device=cond.prompt_embeds.device).repeat(2)
        cond2 = cond.index(rows)
        noisy = policy.add_noise(latents, noise, t2)

        def space(output, x, t):
            return self._to_space(policy, output, x, t)

        model_out = space(policy.predict(noisy, t2, cond2, guidance_scale=1.0), noisy, t2)
        need_tf = self.cpp == "tf" or (self.cpp == "off" and bool(mask.any()))
        with torch.no_grad(), (policy.reference() if reference is None else reference.use(policy)):
            ref_out = space(policy.predict(noisy, t2, cond2, guidance_scale=1.0), noisy, t2)
            tf_l = (space(policy.predict(noisy[bsz:], timesteps, cond_minus, guidance_scale=1.0), noisy[bsz:],
                          timesteps) if need_tf else None)
        if self.cpp == "tf":
            target_w, target_l = ref_out[:bsz], tf_l
        elif self.cpp == "dd":
            with torch.no_grad():
                with self.targets.use(TARGET_ADAPTERS[0]):
                    target_w = space(policy.predict(noisy[:bsz], timesteps, cond, guidance_scale=1.0), noisy[:bsz],
                                     timesteps)
                with self.targets.use(TARGET_ADAPTERS[1]):
                    target_l = space(policy.predict(noisy[bsz:], timesteps, cond, guidance_scale=1.0), noisy[bsz:],
                                     timesteps)
        else:
            target = latents.float() if self.prediction_space == "x0" else policy.training_target(latents, noise, t2)
            target_w, target_l = target[:bsz], target[bsz:]
            if mask.any():
                m = mask.to(device).view(-1, *([1] * (latents_w.ndim - 1)))
                target_w = torch.where(m, ref_out[:bsz], target_w)
                target_l = torch.where(m, tf_l, target_l)
        # 4. per-sample losses and the loss
        weights = timesteps.float() / (num_train_timesteps - 1) if self.loss_weighting == "linear" else None
        loss, metrics = ddspo_loss(
            per_sample_mse(model_out[:bsz], target_w), per_sample_mse(model_out[bsz:], target_l),
            per_sample_mse(ref_out[:bsz], target_w), per_sample_mse(ref_out[bsz:], target_l),
            beta=self.beta, weights=weights,
        )
        metrics["rand_cond_rate"] = mask.float().mean()
        return loss, metrics
