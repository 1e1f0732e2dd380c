"""Model adapters: one file per diffusers family, all implementing `diffalign.models.base.DiffusionPolicy`.

- `stable_diffusion`: SD1.x/2.x (`StableDiffusionPolicy`, ε/v);
- `sdxl`: Stable Diffusion XL (`StableDiffusionXLPolicy`, ε/v; two text encoders, pooled embeddings, time ids);
- `sd3`: SD3/SD3.5 format (`StableDiffusion3Policy`, rectified flow);
- `flux`: FLUX.1 (`FluxPolicy`, rectified flow; packed latents and the guidance input handled inside);
- `text_to_video`: UNet3D text-to-video (`TextToVideoPolicy`, ε/v);
- `wan`: Wan 2.1 (`WanPolicy`, rectified flow).

What they share (the guided forward, the VAE, the LoRA adapter, the two forward processes) is written once in
`pipeline_policy`. The ``tiny_*`` modules build tiny random models of these architectures for tests.
"""

from diffalign.models.base import DiffusionPolicy, FlowDiffusionPolicy
from diffalign.models.pipeline_policy import PipelinePolicy, cfg_batch
from diffalign.models.stable_diffusion import StableDiffusionPolicy, StableDiffusionPolicyConfig
from diffalign.models.tiny_random import (
    TinyRandomPolicyConfig,
    build_tiny_random_pipeline,
    build_tiny_random_policy,
)

__all__ = [
    "DiffusionPolicy",
    "FlowDiffusionPolicy",
    "PipelinePolicy",
    "StableDiffusionPolicy",
    "StableDiffusionPolicyConfig",
    "TinyRandomPolicyConfig",
    "build_tiny_random_pipeline",
    "build_tiny_random_policy",
    "cfg_batch",
]
