"""The model contract: every policy member the package uses is declared by `DiffusionPolicy`, and every family
implements it."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO
from torch import nn

from diffalign.models.base import DiffusionPolicy, FlowDiffusionPolicy

PACKAGE = REPO / "diffalign"
# `policy.x`, `self.policy.x`, `run.policy.x` outside the adapters themselves
USE = re.compile(r"\bpolicy\.([A-Za-z_]\w*)")


def _uses() -> dict[str, set[str]]:
    uses: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "models":
            continue
        for name in USE.findall(path.read_text()):
            uses.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return uses


def _declared() -> set[str]:
    members = set()
    for proto in (DiffusionPolicy, FlowDiffusionPolicy):
        members |= {m for m in vars(proto) if not m.startswith("_")} | set(proto.__annotations__)
    return members


def test_every_policy_member_the_package_uses_is_declared_by_the_protocol():
    """A new family implements `DiffusionPolicy` (plus `torch.nn.Module`) and nothing the loops, samplers, objectives,
    references or evaluation touch is missing: grep the package for ``policy.<member>``."""
    uses = _uses()
    assert {"predict", "encode_prompts", "denoiser", "scheduler"} <= set(uses)  # the grep sees the package's uses
    module_members = set(dir(nn.Module))
    undeclared = {name: sorted(files) for name, files in uses.items()
                  if name not in _declared() and name not in module_members and not name.startswith("__")}
    # `policy.unet`: diffalign-ddcpp-targets and DDSPO's target adapters are for UNet models (SD1.x/2.x, SDXL) only
    assert set(undeclared) <= {"unet"}, undeclared
    assert set(undeclared.get("unet", [])) <= {"diffalign/train/ddcpp_targets.py"}


FAMILIES = {
    "sd": ("diffalign.models.tiny_random", "build_tiny_random_policy", {}),
    "sdxl": ("diffalign.models.tiny_sdxl", "build_tiny_sdxl_policy", {}),
    "sd3": ("diffalign.models.tiny_flow", "build_tiny_flow_policy", {}),
    "t2v": ("diffalign.models.tiny_video", "build_tiny_t2v_policy", {}),
    "wan": ("diffalign.models.tiny_video", "build_tiny_wan_policy", {}),
    "wan22": ("diffalign.models.tiny_video", "build_tiny_wan22_policy", {}),
    "flux": ("diffalign.models.tiny_flux", "build_tiny_flux_policy", {}),
    "flux_cfg": ("diffalign.models.tiny_flux", "build_tiny_flux_policy", {"guidance_embeds": False}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_policy(request):
    import importlib

    module, builder, kwargs = FAMILIES[request.param]
    return request.param, getattr(importlib.import_module(module), builder)(**kwargs)


def test_every_family_implements_the_protocol_and_flow_families_the_flow_protocol(family_policy):
    name, policy = family_policy
    assert isinstance(policy, DiffusionPolicy) and isinstance(policy, nn.Module)
    assert isinstance(policy, FlowDiffusionPolicy) == policy.flow_matching == (policy.prediction_type == "flow")
    assert policy.denoiser is policy.forward_module and policy.lora_rank == 4
    assert policy.modality == ("video" if name in ("t2v", "wan", "wan22") else "image")
    assert policy.num_train_timesteps == policy.scheduler.config.num_train_timesteps == 1000


def test_train_mode_reaches_only_the_denoiser(family_policy):
    _, policy = family_policy
    policy.train()
    assert policy.denoiser.training
    inside = {id(m) for m in policy.denoiser.modules()}  # (Wan 2.2: the experts are also the policy's children)
    assert not any(m.training for m in policy.modules() if m is not policy and id(m) not in inside)
    policy.eval()


def test_the_guided_prediction_is_the_cfg_combination_of_one_batched_call(family_policy):
    """`predict` with w > 1 equals uncond + w (cond − uncond) of two unguided calls (negatives passed as the
    prompts), for every family: the shared template batches ``[negative, positive]`` correctly."""
    from diffalign.types import PromptEmbeds

    name, policy = family_policy
    if name == "flux":  # guidance-distilled: w is the transformer's guidance input, no CFG batch
        pytest.skip("no CFG batch; tests/unit/models/test_models_flux.py checks the guidance input")
    embeds = policy.encode_prompts(["a red circle", "two blue squares"])
    negative = PromptEmbeds(embeds.negative_prompt_embeds, None, embeds.negative_pooled_prompt_embeds)
    x = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500, 700]) if not policy.flow_matching else torch.tensor([500.0, 700.0])
    with torch.no_grad():
        guided = policy.predict(x, t, embeds, guidance_scale=3.0)
        cond, uncond = policy.predict(x, t, embeds), policy.predict(x, t, negative)
    torch.testing.assert_close(guided, uncond + 3.0 * (cond - uncond), rtol=1e-4, atol=1e-5)
