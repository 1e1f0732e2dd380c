"""What the reference strategies share: the second LoRA adapter that holds the reference weights
(`ReferenceAdapter`), the samples cache valid while the reference does not change (`SampleCache`), and the checks of
a saved strategy state."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy


POLICY_ADAPTER = "default"


REFERENCE_ADAPTER = "reference"


LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def _adapter_key(name: str) -> tuple[str, str] | None:
    """``"....to_q.lora_A.default.weight"`` → ``("default", "....to_q.lora_A.weight")``; `None` for non-LoRA names."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[-3].startswith("lora_"):
        return parts[-2], ".".join(parts[:-2] + parts[-1:])
    return None


def require_lora(policy: StableDiffusionPolicy, strategy: str) -> None:
    if policy.lora_rank is None:
        raise ValueError(
            f"reference={strategy} needs a LoRA policy, but model.lora_rank is null (full UNet fine-tune). Set"
            " model.lora_rank (e.g. 64): the reference strategies keep LoRA weights, not UNet copies."
        )


def tensor_bytes(tensors: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind `tensors` (a state dict or a list of them); views of one storage count
    once."""
    dicts = tensors if isinstance(tensors, list) else [tensors]
    storages = {}
    for state in dicts:
        for tensor in state.values():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class ReferenceAdapter:
    """A second LoRA adapter (``"reference"``) on the policy's UNet that holds the reference weights θ_r.

    It copies the policy adapter's peft config (rank, alpha, target modules), so a LoRA state dict of the policy fits
    it. Its parameters are float32, never require grad and are not in `policy.trainable_parameters()`. Adding it does
    not touch the global RNG (the throw-away initialisation runs under `torch.random.fork_rng`).

    State dicts here are keyed like peft's without the adapter name, e.g.
    ``"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"``.

    Args:
        policy (`StableDiffusionPolicy`): a LoRA policy with its adapter named ``"default"``.

    Raises:
        ValueError: if the policy already has a ``"reference"`` adapter. (The strategies' `setup` rejects a policy
            without LoRA before building this.)
    """

    def __init__(self, policy: StableDiffusionPolicy, adapter_name: str = REFERENCE_ADAPTER):
        unet = policy.denoiser
        if adapter_name in unet.peft_config:
            raise ValueError(
                f"the policy's denoiser already has a {adapter_name!r} adapter; call reference.setup(policy) once."
            )
        self.adapter_name = adapter_name
        policy_flags = {id(p): p.requires_grad for p in unet.parameters()}
        devices = [unet.device.index or 0] if unet.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # a second adapter is the point
            # diffusers' add_adapter makes the new adapter the active one; switch straight back to the policy's
            unet.add_adapter(copy.deepcopy(unet.peft_config[POLICY_ADAPTER]), adapter_name=adapter_name)
        unet.set_adapter(POLICY_ADAPTER)
        self.policy_params: dict[str, torch.nn.Parameter] = {}
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, param in unet.named_parameters():
            parsed = _adapter_key(name)
            if parsed is None:
                continue
            adapter, key = parsed
            if adapter == adapter_name:
                param.data = param.data.to(torch.float32)
                param.requires_grad_(False)
                self.params[key] = param
            elif adapter == POLICY_ADAPTER:
                self.policy_params[key] = param
        for param in unet.parameters():  # restore the policy's flags that set_adapter may have flipped
            if id(param) in policy_flags:
                param.requires_grad_(policy_flags[id(param)])
        if set(self.params) != set(self.policy_params) or not self.params:
            raise ValueError("the reference adapter's LoRA tensors do not mirror the policy adapter's; is peft >= 0.17?")
        from peft.tuners.tuners_utils import BaseTunerLayer  # (imported with the model, not with the config checks)

        self.unet = unet
        self.layers = [m for m in unet.modules() if isinstance(m, BaseTunerLayer)]

    @property
    def nbytes(self) -> int:
        """Bytes of the reference adapter's tensors (one adapter)."""
        return tensor_bytes(dict(self.params))

    @torch.no_grad()
    def snapshot_policy(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Detached float32 clones of the policy adapter's current tensors (own storage), on `device` (default: the
        policy's)."""
        return {k: p.detach().to(device=device or p.device, dtype=torch.float32, copy=True)
                for k, p in self.policy_params.items()}

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Copies `state` (keys and shapes of the policy adapter) into the reference adapter, in place.

        Raises:
            ValueError: naming `source` if keys or shapes differ from the policy adapter's.
        """
        if set(state) != set(self.params):
            missing, unexpected = sorted(set(self.params) - set(state)), sorted(set(state) - set(self.params))
            raise ValueError(
                f"{source}: LoRA keys do not match the policy adapter (missing {missing[:2]}, unexpected "
                f"{unexpected[:2]}); it must come from a run with the same model.lora_rank and lora_target_modules."
            )
        for key, param in self.params.items():
            if state[key].shape != param.shape:
                raise ValueError(
                    f"{source}: LoRA tensor {key!r} has shape {tuple(state[key].shape)}, the policy adapter has "
                    f"{tuple(param.shape)}; use the same model.lora_rank."
                )
            param.copy_(state[key])

    @torch.no_grad()
    def lerp_towards_policy(self, weight: float) -> None:
        """θ_r ← θ_r + weight · (θ − θ_r) on every LoRA tensor (an EMA step with decay 1 − weight)."""
        for key, param in self.params.items():
            param.lerp_(self.policy_params[key].detach().float(), weight)

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Runs the UNet with the reference adapter instead of the policy's, in eval mode; both are restored on exit
        (also when the block raises). peft's `set_adapter` marks the activated adapter trainable, so every LoRA
        tensor's `requires_grad` is put back right after the switch: the reference never requires grad."""
        flags = {key: p.requires_grad for key, p in self.policy_params.items()}
        was_training = self.unet.training

        def switch(name: str) -> None:
            for layer in self.layers:
                layer.set_adapter(name)
            for key, param in self.params.items():
                param.requires_grad_(False)
                self.policy_params[key].requires_grad_(flags[key])

        switch(self.adapter_name)
        self.unet.eval()
        try:
            yield
        finally:
            switch(POLICY_ADAPTER)
            self.unet.train(was_training)


class SampleCache:
    """Samples generated by the current reference, by key (a prompt or a data id), on CPU; emptied by the reference
    strategy whenever θ_r changes. Memory: one latent per key (64 KiB for a 4×64×64 float32 SD1.5 latent)."""

    def __init__(self):
        self.items: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.items)

    def clear(self) -> None:
        self.items.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"keys": list(self.items), "values": dict(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = {key: state["values"][key].clone() for key in state["keys"]}


def check_strategy(state: dict[str, Any], strategy: str) -> None:
    if state.get("strategy") != strategy:
        raise ValueError(
            f"the checkpoint's reference state is for reference={state.get('strategy')!r}, this run uses "
            f"reference={strategy!r}; resume with the run's original reference config."
        )
