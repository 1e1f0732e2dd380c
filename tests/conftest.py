"""Shared pytest fixtures: tiny real diffusers components built in-process (no network, no hub files)."""

from __future__ import annotations

import os

# No test may reach the network: huggingface_hub / transformers / open_clip read only the local cache (set before
# huggingface_hub is first imported, which reads it once).
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from diffalign.models.tiny_random import build_tiny_random_policy

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP oversubscription makes every op
# 30-40x slower; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)

# The SD1.5 DDIM scheduler config, written out here independently of the code under test.
SD15_DDIM_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "clip_sample": False,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}


def perturb_lora_(policy, std: float = 0.2, seed: int = 1) -> None:
    """Gives every LoRA matrix random values in place (fresh LoRA B matrices are zero, so the adapter would be a no-op
    and tests comparing adapted vs base outputs could not fail)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


@pytest.fixture
def sd15_ddim_config() -> dict:
    """A copy of the SD1.5 DDIM scheduler config."""
    return dict(SD15_DDIM_CONFIG)


@pytest.fixture
def tiny_policy():
    """Tiny random SD policy (base seed 0, LoRA rank 4) whose LoRA weights are perturbed (see `perturb_lora_`)."""
    torch.manual_seed(0)
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy)
    return policy


@pytest.fixture
def perturb_lora():
    """The `perturb_lora_(policy, std=0.2, seed=1)` helper, for tests that build their own policies."""
    return perturb_lora_
