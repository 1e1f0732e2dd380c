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

import importlib

_EXPORTS = {
    "DiffusionPolicy": "base",
    "FlowDiffusionPolicy": "base",
    "PipelinePolicy": "pipeline_policy",
    "cfg_batch": "pipeline_policy",
    "StableDiffusionPolicy": "stable_diffusion",
    "StableDiffusionPolicyConfig": "stable_diffusion",
    "TinyRandomPolicyConfig": "tiny_random",
    "build_tiny_random_pipeline": "tiny_random",
    "build_tiny_random_policy": "tiny_random",
}
"""Name → module of this package: imported when the name is first read (PEP 562, as diffusers' own `_LazyModule`),
so that importing one light module (`diffalign.models.base`, `diffalign.models.checks`, as the config checks and the
samplers do) does not import diffusers, transformers and peft with the adapters."""

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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
