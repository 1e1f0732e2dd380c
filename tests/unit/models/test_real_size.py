"""The real-size architectures (``configs/arch/*.json``, the published configs of SD1.5, SDXL, SD3.5-Medium,
Wan2.1-T2V-1.3B and FLUX.1-dev): built on the meta device, their parameter counts are the published figures or an
independent count by hand from the config; the LoRA of each ``model=`` config (its rank and targets) has r × Σ(in +
out) parameters over the targeted layers, counted by hand; SD1.5 (the one that fits in a few GiB) is wrapped by the
project's policy and runs one forward at its minimum size, and FLUX.1-dev (33 GB in bfloat16, more than this machine
has) runs as a real-width slice, one block of each kind. The step of every method at real size is
``scripts/bench_real_size.py`` (docs/guides/real_size.md; FLUX.1-dev and Wan 2.2 as real-width, reduced-depth
stand-ins)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from conftest import REPO, load_script

from diffalign.models.base import add_trainable_lora

pytestmark = pytest.mark.slow

ARCH = REPO / "configs" / "arch"


def _bench():
    return load_script("bench_real_size")


def _arch(name: str) -> dict:
    return json.loads((ARCH / f"{name}.json").read_text())


def _meta(name: str, component: str):
    return _bench().build_component(_arch(name)["components"][component], device="meta")


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _model_config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text())


def test_published_parameter_counts():
    # SD v1 model card (CompVis/stable-diffusion): "860M UNet and 123M text encoder"; the exact UNet count is the
    # well-known 859.52 M
    assert abs(_count(_meta("sd15", "unet")) / 1e6 - 859.52) < 0.005
    assert round(_count(_meta("sd15", "text_encoder")) / 1e6) == 123
    # SDXL report (Podell et al., arXiv:2307.01952, Table 1): UNet 2.6B, text encoders 817M in all (817.7 M:
    # the table truncates)
    assert round(_count(_meta("sdxl", "unet")) / 1e8) / 10 == 2.6
    assert (_count(_meta("sdxl", "text_encoder")) + _count(_meta("sdxl", "text_encoder_2"))) // 10**6 == 817


def test_sd35_medium_transformer_counted_by_hand():
    """SD3.5-Medium's MMDiT-X, counted block by block from its config (hidden d = 24 heads × 64 = 1536): a joint block
    has AdaLN-Zero for both streams (6d² + 6d each), the joint attention (q, k, v, out and the context's q, k, v,
    out: 8(d² + d), plus RMS q/k norms of 64 per stream: 256), and both MLPs (8d² + 5d each); the 13 dual-attention
    blocks add a second attention (4(d² + d) + 128) and 3 more modulation rows (3d² + 3d); the last block keeps only
    the image stream's MLP and output, its context gets a continuous AdaLN (2d² + 2d). Outside the blocks: the 2x2
    patch embedding (16·4·d + d), the timestep MLP (256d + d + d² + d), the pooled-text MLP (2048d + d + d² + d), the
    context embedder (4096d + d), the output AdaLN (2d² + 2d) and projection (64d + 64)."""
    config = _arch("sd35_medium")["components"]["transformer"]["config"]
    d = config["num_attention_heads"] * config["attention_head_dim"]
    assert d == config["caption_projection_dim"] == 1536
    joint = 36 * d * d + 30 * d + 256
    dual = joint + 7 * d * d + 7 * d + 128
    last = 23 * d * d + 20 * d + 256
    n_dual = len(config["dual_attention_layers"])
    blocks = n_dual * dual + (config["num_layers"] - n_dual - 1) * joint + last
    outside = (65 * d) + (256 * d + d + d * d + d) + (2048 * d + d + d * d + d) + (4096 * d + d) + (2 * d * d + 2 * d) \
        + (64 * d + 64)
    assert _count(_meta("sd35_medium", "transformer")) == blocks + outside == 2_243_171_520


def test_wan_transformer_counted_by_hand():
    """Wan2.1-T2V-1.3B (the Wan report's table: dim 1536, FFN 8960, 12 heads, 30 layers), counted from its config:
    per block self- and cross-attention (4(d² + d) and RMS q/k norms 2d each), the cross-attention's affine
    LayerNorm (2d), the FFN (2df + f + d) and the modulation table (6d); outside, the (1, 2, 2) patch embedding,
    the time MLP (256d + d + d² + d) and its projection to 6d, the text MLP (4096d + d + d² + d), the output
    projection (64d + 64) and its modulation (2d)."""
    config = _arch("wan21_t2v_1_3b")["components"]["transformer"]["config"]
    d, f = config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"]
    assert (d, f, config["num_attention_heads"], config["num_layers"]) == (1536, 8960, 12, 30)
    block = 8 * (d * d + d) + 4 * d + 2 * d + (2 * d * f + f + d) + 6 * d
    outside = (64 * d + d) + (256 * d + d + d * d + d) + (6 * d * d + 6 * d) + (4096 * d + d + d * d + d) \
        + (64 * d + 64) + 2 * d
    assert _count(_meta("wan21_t2v_1_3b", "transformer")) == config["num_layers"] * block + outside == 1_418_996_800


def test_flux1_dev_transformer_counted_by_hand():
    """FLUX.1-dev's transformer (the model card's "12 billion parameter rectified flow transformer"), counted block by
    block from its config (d = 24 heads × 128 = 3072, MLP 4d): a double-stream block has AdaLN-Zero for both streams
    (6d² + 6d each), q, k, v, out for the image stream and for the text stream (8(d² + d)), RMS q/k norms of 128 per
    stream (4 · 128), and both MLPs (8d² + 5d each); a single-stream block has a 3d modulation (3d² + 3d), q, k, v
    (3(d² + d)) with q/k norms (2 · 128), the MLP input (4d² + 4d) and one output projection from the concatenated
    attention and MLP (5d · d + d). Outside the blocks: the packed-latent embedding (64d + d), the timestep and the
    guidance MLPs (256d + d + d² + d each), the pooled-text MLP (768d + d + d² + d), the T5 context embedder
    (4096d + d), the output AdaLN (2d² + 2d) and projection (64d + 64). The encoders: CLIP-L's text tower is the 123 M
    of SD1.x's, T5 v1.1 XXL's encoder 4.76 B."""
    config = _arch("flux1_dev")["components"]["transformer"]["config"]
    d = config["num_attention_heads"] * config["attention_head_dim"]
    assert (d, config["num_layers"], config["num_single_layers"]) == (3072, 19, 38) and config["guidance_embeds"]
    double = 36 * d * d + 30 * d + 4 * 128
    single = 15 * d * d + 11 * d + 2 * 128
    outside = (65 * d) + 2 * (256 * d + d + d * d + d) + (768 * d + d + d * d + d) + (4096 * d + d) \
        + (2 * d * d + 2 * d) + (64 * d + 64)
    count = _count(_meta("flux1_dev", "transformer"))
    assert count == 19 * double + 38 * single + outside == 11_901_408_320
    assert round(count / 1e9) == 12
    assert round(_count(_meta("flux1_dev", "text_encoder")) / 1e6) == 123
    assert round(_count(_meta("flux1_dev", "text_encoder_2")) / 1e7) == 476


def test_flux1_dev_width_runs_with_the_policy_one_block_of_each_kind():
    """The full FLUX.1-dev (11.9 B transformer + 4.8 B T5, 33 GB in bfloat16) does not fit this CPU machine's memory:
    a slice of it runs instead — FLUX.1-dev's transformer config with one double- and one single-stream block (real
    width, heads, rotary axes, guidance embedding), the real VAE and CLIP-L text tower, and a one-layer stand-in of T5
    with its real output width (4096, 512 tokens), all random bfloat16 — wrapped by the project's policy with the
    ``model=flux1_dev`` LoRA (r 32 on the attention projections), at 128 px (unpacked latents 16×16×16, 64 packed
    tokens), guidance 3.5 through the guidance input."""
    from diffusers import FluxPipeline
    from transformers import T5Config, T5EncoderModel

    from diffalign.models.flux import FluxPolicy

    bench = _bench()
    arch = _arch("flux1_dev")
    spec = arch["components"]["transformer"]
    sliced = {**arch, "components": {**arch["components"], "transformer": {
        **spec, "config": {**spec["config"], "num_layers": 1, "num_single_layers": 1}},
        "text_encoder_2": {**arch["components"]["text_encoder_2"], "stand_in": "skip"}}}
    components = bench.build_components(sliced)
    tokenizer = components["tokenizer_2"]
    torch.manual_seed(0)
    components["text_encoder_2"] = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=4096, d_kv=8, d_ff=16, num_layers=1, num_heads=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)).to(torch.bfloat16)
    pipe = FluxPipeline(**components)
    cfg = _model_config("flux1_dev")
    policy = FluxPolicy(pipe, height=128, width=128, lora_rank=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"],
                        max_sequence_length=cfg["max_sequence_length"])
    assert policy.latent_shape == (16, 16, 16) and policy.vae_scale_factor == 8 and policy.dtype == torch.bfloat16
    assert sum(p.numel() for p in policy.trainable_parameters()) == 32 * 2 * 3072 * (8 + 3)
    embeds = policy.encode_prompts(["a red circle", "two blue squares"])
    assert embeds.prompt_embeds.shape == (2, 512, 4096) and embeds.pooled_prompt_embeds.shape == (2, 768)
    assert embeds.negative_prompt_embeds is None  # guidance-distilled: no negative branch
    latents = torch.randn(2, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([1000.0, 500.0])
    with torch.no_grad():
        out = policy.predict(latents, timesteps, embeds, guidance_scale=3.5)
        with policy.reference():
            base = policy.predict(latents, timesteps, embeds, guidance_scale=3.5)
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
        moved = policy.predict(latents, timesteps, embeds, guidance_scale=3.5)
        images = policy.decode(latents)
    assert out.shape == (2, 16, 16, 16) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.equal(out, base) and not torch.equal(moved, base)
    assert images.shape == (2, 3, 128, 128)
    policy.scheduler.set_timesteps(4)  # 64 tokens: mu = 0.5 + (64 - 256) * 0.65 / 3840
    mu = 0.5 + (64 - 256) * 0.65 / 3840
    assert float(policy.scheduler.sigmas[1]) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / 0.75 - 1), rel=1e-6)


def test_wan22_a14b_experts_counted_by_hand():
    """Wan2.2-T2V-A14B (config ``wan/configs/wan_t2v_A14B.py`` of the Wan2.2 release: dim 5120, FFN 13824, 40 heads,
    40 layers, boundary 0.875, two experts of this architecture): one expert built on the meta device with the
    diffusers config of that architecture has the count of `test_wan_transformer_counted_by_hand`'s formula at d =
    5120 — 14.3 B (Wan 2.1-14B's architecture), 28.6 B for the two experts, one of them active per step;
    `model=wan22_t2v_a14b`'s LoRA is r × 2d × 8 × 40 per expert, on both experts. Nothing
    of it runs on this CPU machine (57 GB of bfloat16 experts); the two-expert logic is tested on the tiny model
    (tests/unit/models/test_models_wan22.py)."""
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    with init_empty_weights(include_buffers=True):
        expert = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                                       in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                                       num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                       eps=1e-6, rope_max_seq_len=1024)
    d, f, layers = 5120, 13824, 40
    block = 8 * (d * d + d) + 4 * d + 2 * d + (2 * d * f + f + d) + 6 * d
    outside = (64 * d + d) + (256 * d + d + d * d + d) + (6 * d * d + 6 * d) + (4096 * d + d + d * d + d) \
        + (64 * d + 64) + 2 * d
    count = _count(expert)
    assert count == layers * block + outside
    assert round(count / 1e8) / 10 == 14.3
    cfg = _model_config("wan22_t2v_a14b")
    assert cfg["lora_experts"] == "both" and cfg["flow_shift"] == 12.0 and cfg["guidance_scale_2"] == 3.0
    add_trainable_lora(expert, cfg["lora_rank"], cfg["lora_alpha"], ["attn1.to_q", "attn1.to_k", "attn1.to_v",
                       "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"], 0)
    assert sum(p.numel() for p in expert.parameters() if p.requires_grad) == cfg["lora_rank"] * 2 * d * 8 * layers


def _flux_blocks(d: int) -> tuple[int, int, int]:
    """(double-stream block, single-stream block, outside the blocks) parameters of a FLUX transformer of width d, the
    block-by-block count of `test_flux1_dev_transformer_counted_by_hand`."""
    outside = (65 * d) + 2 * (256 * d + d + d * d + d) + (768 * d + d + d * d + d) + (4096 * d + d) \
        + (2 * d * d + 2 * d) + (64 * d + 64)
    return 36 * d * d + 30 * d + 4 * 128, 15 * d * d + 11 * d + 2 * 128, outside


def _wan_blocks(d: int, f: int) -> tuple[int, int]:
    """(block, outside the blocks) parameters of a Wan transformer of width d and FFN f, the count of
    `test_wan22_a14b_experts_counted_by_hand`."""
    block = 8 * (d * d + d) + 4 * d + 2 * d + (2 * d * f + f + d) + 6 * d
    outside = (64 * d + d) + (256 * d + d + d * d + d) + (6 * d * d + 6 * d) + (4096 * d + d + d * d + d) \
        + (64 * d + 64) + 2 * d
    return block, outside


def test_the_real_size_benchmark_sizes_flux_and_wan22_as_published_and_runs_their_slices():
    """``scripts/bench_real_size.py``'s FLUX.1-dev and Wan2.2-T2V-A14B entries, on the meta device: the published
    configs give FLUX.1-dev's transformer 11.9 B (the hub's count; "12 billion" in the model card) and each Wan 2.2
    expert the 14.3 B of the Wan 14B architecture (the "A14B" of its name, 14 B to the nearest billion), both within
    1 % and exactly the block-by-block counts; the Wan 2.2 arch file (built from diffusers' conversion script, no
    hub access) has two experts of the release's config (dim 5120, FFN 13824, 40 heads, 40 layers) and boundary
    0.875. What the rows run: the same configs with 1 + 1 FLUX blocks and 1 layer per Wan expert, so each stand-in
    is the published count less the blocks it drops."""
    bench = _bench()
    flux = bench.published_sizes(bench.load_arch(bench.MODELS["flux1_dev"]["arch"]))
    double, single, outside = _flux_blocks(3072)
    assert abs(flux["transformer"] / 11.9e9 - 1) < 0.01 and flux["transformer"] == 19 * double + 38 * single + outside
    flux_run = bench.published_sizes(bench.run_arch("flux1_dev"))
    assert flux_run["transformer"] == double + single + outside
    assert {k: v for k, v in flux_run.items() if k != "transformer"} == {k: v for k, v in flux.items()
                                                                       if k != "transformer"}

    arch = bench.load_arch(bench.MODELS["wan22_t2v_a14b"]["arch"])
    config = arch["components"]["transformer"]["config"]
    assert arch["components"]["transformer_2"]["config"] == config
    assert (config["num_attention_heads"] * config["attention_head_dim"], config["ffn_dim"], config["num_layers"]) \
        == (5120, 13824, 40)
    assert arch["pipeline_kwargs"] == {"boundary_ratio": 0.875}
    wan = bench.published_sizes(arch)
    block, outside = _wan_blocks(5120, 13824)
    for expert in ("transformer", "transformer_2"):
        assert wan[expert] == 40 * block + outside and abs(wan[expert] / 14.3e9 - 1) < 0.01
        assert round(wan[expert] / 1e9) == 14
    wan_run = bench.published_sizes(bench.run_arch("wan22_t2v_a14b"))
    assert wan_run["transformer"] == wan_run["transformer_2"] == block + outside
    assert wan_run["vae"] == wan["vae"] == bench.published_sizes(bench.load_arch("wan21_t2v_1_3b"))["vae"]


@pytest.mark.parametrize("model", ["flux1_dev", "wan22_t2v_a14b"])
def test_the_real_size_rows_of_flux_and_wan22_compose_and_pass_the_checks(model, tmp_path):
    """The training config a FLUX.1-dev / Wan 2.2 row's child composes (its overrides, with the weightless folder of
    ``--in-memory``: model_index.json and the configs) passes ``check_run``: FLUX at 16 px through the policy's
    height/width, Wan 2.2 with 6 steps so that flow_grpo's 5 trained transitions reach the low-noise expert (shift
    12: σ = 1/3 maps to t = 12σ / (1 + 11σ) = 0.857 < the boundary 0.875; the 4th step, σ = 1/2, to 0.923)."""
    from conftest import compose_cfg

    from diffalign.train.prepare import check_run

    bench = _bench()
    size = bench.MODELS[model]["min"]
    folder = bench.model_folder(model, bench.folder_size(model, size), tmp_path, in_memory=True)
    overrides = bench.overrides_for(model, "flow_grpo", "bfloat16", folder, size, tmp_path, tmp_path / "run")
    cfg = compose_cfg(overrides)
    check_run(cfg, overrides)
    assert cfg.model.torch_dtype == "bfloat16" and cfg.online.group_size == 2
    assert cfg.trainer.lr_warmup_steps == 0  # a warmup's first update has learning rate 0: the LoRA would not move
    if model == "flux1_dev":
        assert (cfg.model.height, cfg.model.width) == (16, 16) and cfg.sampler.guidance_scale == 3.5
    else:
        assert cfg.sampler.num_inference_steps == 6 and cfg.model.lora_experts == "both"
        shift, sigmas = cfg.model.flow_shift, [1 - k / 6 for k in range(6)]
        t = [shift * s / (1 + (shift - 1) * s) for s in sigmas]
        assert [x >= 0.875 for x in t[:5]] == [True, True, True, True, False]


def _unet_attention_layers(config: dict) -> list[tuple[int, int]]:
    """(channels, number of transformer blocks) of every attention stage of a UNet2DConditionModel config: down
    blocks ``layers_per_block`` attentions, up blocks one more, the mid block one, each
    ``transformer_layers_per_block`` deep."""
    channels = config["block_out_channels"]
    depth = config.get("transformer_layers_per_block", 1)
    depth = [depth] * len(channels) if isinstance(depth, int) else depth
    out = []
    for i, kind in enumerate(config["down_block_types"]):
        if kind.startswith("CrossAttn"):
            out.append((channels[i], config["layers_per_block"] * depth[i]))
    out.append((channels[-1], depth[-1]))  # UNetMidBlock2DCrossAttn
    for i, kind in enumerate(config["up_block_types"]):
        level = len(channels) - 1 - i
        if kind.startswith("CrossAttn"):
            out.append((channels[level], (config["layers_per_block"] + 1) * depth[level]))
    return out


def _unet_lora_by_hand(config: dict, rank: int) -> int:
    """LoRA on to_q, to_k, to_v, to_out.0 of both attentions of every transformer block: self-attention 4 × (C + C);
    cross-attention to_q and to_out (C + C) each, to_k and to_v (D + C) each; all times the rank."""
    cross = config["cross_attention_dim"]
    return rank * sum(blocks * (4 * 2 * c + 2 * 2 * c + 2 * (cross + c)) for c, blocks in _unet_attention_layers(config))


@pytest.mark.parametrize("arch_name, model_name, by_hand", [
    ("sd15", "sd15", lambda c, r: _unet_lora_by_hand(c, r)),
    ("sdxl", "sdxl", lambda c, r: _unet_lora_by_hand(c, r)),
    # 24 joint blocks: q, k, v, out and the context's q, k, v (d → d) in every block, the context's output in all
    # but the last (context_pre_only); d = 1536
    ("sd35_medium", "sd35_medium", lambda c, r: r * 2 * 1536 * (24 * 7 + 23)),
    # 30 blocks: q, k, v, out of the self- and the cross-attention, d → d (the text is projected to d first)
    ("wan21_t2v_1_3b", "wan21_t2v", lambda c, r: r * 2 * 1536 * 8 * 30),
    # 19 double blocks: q, k, v, out and the context's q, k, v, out (d → d); 38 single blocks: q, k, v (their
    # attention has no output projection, proj_out is outside it); d = 3072
    ("flux1_dev", "flux1_dev", lambda c, r: r * 2 * 3072 * (19 * 8 + 38 * 3)),
])
def test_lora_parameters_counted_by_hand(arch_name, model_name, by_hand):
    arch = _arch(arch_name)
    config = arch["components"][arch["denoiser"]]["config"]
    model_cfg = _model_config(model_name)
    module = __import__(arch["policy"].rsplit(".", 1)[0], fromlist=["x"])
    targets = model_cfg.get("lora_target_modules") or next(
        getattr(module, n) for n in dir(module) if n.startswith("DEFAULT_") and n.endswith("TARGET_MODULES"))
    denoiser = _meta(arch_name, arch["denoiser"])
    add_trainable_lora(denoiser, model_cfg["lora_rank"], model_cfg["lora_alpha"], list(targets), 0)
    trainable = sum(p.numel() for p in denoiser.parameters() if p.requires_grad)
    assert trainable == by_hand(config, model_cfg["lora_rank"])


def test_sd15_unet_lora_matches_the_known_rank4_figure():
    # diffusers' SD1.5 attention LoRA at rank 4 (to_q, to_k, to_v, to_out.0) has 797,184 parameters
    assert _unet_lora_by_hand(_arch("sd15")["components"]["unet"]["config"], 4) == 797_184


def test_sd15_builds_with_the_policy_and_runs_one_forward_at_minimum_size():
    """SD1.5 at its published size (random bfloat16 weights, ~2 GiB, built in memory: the benchmark script exercises
    ``from_pretrained`` on a written folder, which needs 2 GB of disk) wrapped by the project's policy with the
    ``model=sd15`` config's LoRA (rank 64 on the attention projections), run once at 64 px (latents 4x8x8, the
    UNet's smallest: it halves three times) with classifier-free guidance."""
    from diffusers import StableDiffusionPipeline

    from diffalign.models.stable_diffusion import StableDiffusionPolicy

    arch = _arch("sd15")
    pipe = StableDiffusionPipeline(**_bench().build_components(arch, sample_size=8), **arch["pipeline_kwargs"])
    cfg = _model_config("sd15")
    policy = StableDiffusionPolicy.from_pipeline(pipe, lora_rank=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"])
    lora = sum(p.numel() for p in policy.trainable_parameters())
    assert _count(policy.unet) - lora == 859_520_964
    assert lora == 64 * 199_296 and policy.latent_shape == (4, 8, 8)
    embeds = policy.encode_prompts(["a red circle", "two blue squares"])
    assert embeds.prompt_embeds.shape == (2, 77, 768)
    latents = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([999, 500])
    with torch.no_grad():
        out = policy.predict(latents, timesteps, embeds, guidance_scale=7.5)
        with policy.reference():
            base = policy.predict(latents, timesteps, embeds, guidance_scale=7.5)
    assert out.shape == (2, 4, 8, 8) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.equal(out, base)  # a fresh adapter (B = 0) leaves the base model unchanged
    with torch.no_grad():
        for name, p in policy.unet.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
        moved = policy.predict(latents, timesteps, embeds, guidance_scale=7.5)
    assert not torch.equal(moved, base)
