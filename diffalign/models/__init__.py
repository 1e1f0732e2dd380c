"""Model adapters: one file per diffusers family, all implementing `diffalign.models.base.DiffusionPolicy`."""

from diffalign.models.base import DiffusionPolicy
from diffalign.models.stable_diffusion import StableDiffusionPolicy, StableDiffusionPolicyConfig, cfg_batch
from diffalign.models.tiny_random import (
    TinyRandomPolicyConfig,
    build_tiny_random_pipeline,
    build_tiny_random_policy,
)

__all__ = [
    "DiffusionPolicy",
    "StableDiffusionPolicy",
    "StableDiffusionPolicyConfig",
    "TinyRandomPolicyConfig",
    "build_tiny_random_pipeline",
    "build_tiny_random_policy",
    "cfg_batch",
]
