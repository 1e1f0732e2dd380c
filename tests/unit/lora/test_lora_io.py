"""LoRA interchange (diffalign/lora/io.py, diffalign-export; docs/guides/lora.md): diffalign's files ↔ kohya format ↔
diffusers format, proved against diffusers' own kohya writer and reader, diffusers' `load_lora_weights` on the shipped
tiny SD model, an SDXL-layout UNet and the tiny SD3 model; and the errors of files diffalign does not read."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import safetensors
import safetensors.torch
import torch
from conftest import perturb_lora_
from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.loaders import StableDiffusionLoraLoaderMixin, StableDiffusionXLLoraLoaderMixin
from diffusers.utils import convert_state_dict_to_kohya, convert_unet_state_dict_to_peft

from diffalign.config.compose import asset_path
from diffalign.lora.export import export, main
from diffalign.lora.io import (
    LAYOUTS,
    kohya_state_dict,
    layout_of_denoiser,
    module_vocabulary,
    policy_lora,
    read_lora,
    sd3_vocabulary,
    unflatten_module_name,
    write_kohya,
)
from diffalign.models.base import add_trainable_lora
from diffalign.models.sd3 import StableDiffusion3Policy
from diffalign.models.stable_diffusion import StableDiffusionPolicy

# every kind of UNet layer a LoRA can adapt: attention, feed-forward, projections, ResNet convolutions, time embedding
SD_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2", "proj_in", "proj_out", "conv1", "conv2",
              "conv_shortcut", "time_emb_proj"]


def same_tensors(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].float(), b[k].float()) for k in a)


@pytest.fixture(scope="module")
def sd_policy():
    """The shipped tiny SD model with a random LoRA on every layer kind, r 4, alpha 2 (scale 0.5, not 1)."""
    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), lora_rank=4, lora_alpha=2,
                                                   lora_target_modules=SD_TARGETS)
    perturb_lora_(policy, std=0.3)
    return policy


@pytest.fixture(scope="module")
def sd3_policy():
    policy = StableDiffusion3Policy.from_pretrained(asset_path("tiny_sd3"), load_t5=False, max_sequence_length=8,
                                                lora_rank=4, lora_alpha=8)
    perturb_lora_(policy, std=0.3)
    return policy


def unet_output(unet, seed=0, **added):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, unet.config.in_channels, 8, 8, generator=g)
    text = torch.randn(2, 5, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([10, 700]), encoder_hidden_states=text, **added).sample


# ------------------------------------------------------------------------------------------------- SD1.x / 2.x


def test_run_folder_to_kohya_and_back_is_exact(tmp_path, sd_policy):
    sd_policy.save_lora_weights(tmp_path / "final")
    ours = read_lora(tmp_path / "final")
    policy = policy_lora(sd_policy)
    assert same_tensors(ours.state, policy.state)
    assert (ours.source, ours.component, ours.rank, ours.alpha) == ("diffusers", "unet", 4, 2.0)
    assert ours.target_modules == sorted(SD_TARGETS)  # the adapter config saved as metadata
    assert len(ours.modules) > 40 and any("conv_shortcut" in m for m in ours.modules)

    file = export(str(tmp_path), str(tmp_path / "run.safetensors"))  # a run folder stands for its final/
    back = read_lora(file)
    assert back.source == "kohya" and same_tensors(back.state, ours.state)
    assert (back.rank, back.alpha, back.target_modules) == (4, 2.0, ours.target_modules)
    with safetensors.safe_open(str(file), framework="pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert all(k.startswith("lora_unet_") and k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha"))
               for k in keys)
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "2"

    folder = tmp_path / "as-diffusers"
    export(str(file), str(folder), fmt="diffusers")
    assert same_tensors(read_lora(folder).state, ours.state)
    assert read_lora(folder).settings == ours.settings


def test_lora_files_get_the_umasks_permissions_not_safetensors_0600(tmp_path, sd_policy):
    """safetensors writes files 0600 whatever the umask; a LoRA folder, a kohya export and a diffusers export must be
    readable as any other file of the process (0644 under umask 022, 0640 under 027), e.g. by a ComfyUI of another
    user."""
    import os
    import stat

    saved = os.umask(0o022)
    try:
        for mask, mode in ((0o022, 0o644), (0o027, 0o640)):
            os.umask(mask)
            out = tmp_path / f"umask{mask:o}"
            sd_policy.save_lora_weights(out / "final")
            files = [out / "final" / "pytorch_lora_weights.safetensors",
                     export(str(out / "final"), str(out / "lora.safetensors")),
                     export(str(out / "final"), str(out / "as-diffusers"), fmt="diffusers")]
            for file in files:
                assert stat.S_IMODE(os.stat(file).st_mode) == mode, (file, oct(os.stat(file).st_mode))
    finally:
        os.umask(saved)


def test_kohya_keys_are_diffusers_own_and_its_kohya_reader_inverts_them(tmp_path, sd_policy):
    """diffusers' peft→kohya writer (`convert_state_dict_to_kohya`) names the same keys (but writes alpha = r, which
    is wrong for alpha ≠ r); diffusers' kohya reader (what `load_lora_weights` runs) returns the policy's tensors."""
    policy = policy_lora(sd_policy)
    ours = kohya_state_dict(policy)
    theirs = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in policy.state.items()})
    assert set(ours) == set(theirs)
    alphas = {k: v.item() for k, v in ours.items() if k.endswith(".alpha")}
    assert set(alphas.values()) == {2.0} and {v.item() for k, v in theirs.items() if k.endswith(".alpha")} == {4}

    converted, network_alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(dict(ours))
    peft = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})
    assert same_tensors(peft, policy.state)
    assert set(network_alphas.values()) == {2.0}


def test_exported_kohya_file_loads_in_diffusers_with_the_policys_output(tmp_path, sd_policy):
    file = write_kohya(policy_lora(sd_policy), tmp_path / "lora.safetensors")
    pipe = StableDiffusionPipeline.from_pretrained(asset_path("tiny_sd"), safety_checker=None,
                                                   requires_safety_checker=False)
    base = unet_output(pipe.unet)
    pipe.load_lora_weights(str(file))  # diffusers' own kohya conversion
    config = next(iter(pipe.unet.peft_config.values()))
    assert config.r == 4 and config.lora_alpha == 2
    got = unet_output(pipe.unet)
    want = unet_output(sd_policy.unet)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - base).abs().max() > 1e-2  # the LoRA changes the output (so the comparison can fail)


def test_a_kohya_file_exported_as_diffusers_folder_is_a_checkpoint_diffalign_eval_reads(tmp_path, sd_policy):
    """diffalign-eval's checkpoint=<folder> path: the folder's metadata gives the adapter settings
    (`saved_lora_settings`, as `diffalign.cli._adopt_saved_lora_settings` reads them) and the policy loads it."""
    from diffalign.models.base import saved_lora_settings

    bare = tmp_path / "third-party.safetensors"  # a kohya file without diffalign's metadata
    safetensors.torch.save_file(kohya_state_dict(policy_lora(sd_policy)), str(bare))
    export(str(bare), str(tmp_path / "imported"), fmt="diffusers")
    settings = saved_lora_settings(tmp_path / "imported")
    assert settings == read_lora(bare).settings
    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), **settings)
    policy.load_lora_weights(tmp_path / "imported")
    torch.testing.assert_close(unet_output(policy.unet), unet_output(sd_policy.unet), rtol=0, atol=1e-6)


def test_half_precision_export(tmp_path, sd_policy):
    full = write_kohya(policy_lora(sd_policy), tmp_path / "f32.safetensors")
    export(str(full), str(tmp_path / "f16.safetensors"), dtype="float16")
    half = safetensors.torch.load_file(tmp_path / "f16.safetensors")
    assert all(v.dtype == (torch.float32 if k.endswith(".alpha") else torch.float16) for k, v in half.items())
    back = read_lora(tmp_path / "f16.safetensors")
    for key, value in read_lora(full).state.items():
        torch.testing.assert_close(back.state[key].float(), value, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------- SDXL


def tiny_sdxl_unet() -> UNet2DConditionModel:
    """A UNet with SDXL's block layout at tiny size: added text/time conditioning, 2 transformer layers per block in
    the deeper level, linear projections (the SDXL test UNet of diffusers' own test suite)."""
    torch.manual_seed(0)
    return UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=2, sample_size=8, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
                                use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                                transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
                                cross_attention_dim=64, norm_num_groups=1)


def test_sdxl_unet_exports_with_the_sdxl_entry_and_diffusers_sdxl_loader_reads_it(tmp_path):
    unet = tiny_sdxl_unet()
    add_trainable_lora(unet, 4, 8.0, SD_TARGETS, lora_seed=0)
    perturb_lora_(SimpleNamespace(trainable_parameters=lambda: [p for p in unet.parameters() if p.requires_grad]))
    assert layout_of_denoiser(unet) is LAYOUTS["sdxl"]
    weights = policy_lora(SimpleNamespace(denoiser=unet, unet=unet))
    file = export_sdxl = write_kohya(weights, tmp_path / "xl.safetensors")
    with safetensors.safe_open(str(export_sdxl), framework="pt") as f:
        assert f.metadata()["ss_base_model_version"] == "sdxl_base_v1-0"
    back = read_lora(file)
    assert back.layout is LAYOUTS["sdxl"] and same_tensors(back.state, weights.state)

    fresh = tiny_sdxl_unet()  # what StableDiffusionXLPipeline.load_lora_weights does with the file, on the UNet
    state, alphas = StableDiffusionXLLoraLoaderMixin.lora_state_dict(str(file), unet_config=fresh.config)
    fresh.load_lora_adapter(state, prefix="unet", network_alphas=alphas)
    added = {"added_cond_kwargs": {"text_embeds": torch.randn(2, 32, generator=torch.Generator().manual_seed(1)),
                                   "time_ids": torch.tensor([[8.0, 8, 0, 0, 8, 8]] * 2)}}
    torch.testing.assert_close(unet_output(fresh, **added), unet_output(unet, **added), rtol=0, atol=1e-6)


def test_sdxl_kohya_files_in_the_original_unet_naming_are_read(tmp_path):
    """kohya sd-scripts writes SDXL LoRAs with the original UNet's names (input_blocks.<i>.<j>): with 2 layers per
    block, input block i = 1 + 3·block + layer (j = 1: its attention), output block i = 3·block + layer, the middle
    block's attention is middle_block.1 (diffusers' `_maybe_map_sgm_blocks_to_diffusers`, run by read_lora)."""
    unet = tiny_sdxl_unet()
    names = {
        "input_blocks_4_1_transformer_blocks_1_attn1_to_q": "down_blocks.1.attentions.0.transformer_blocks.1.attn1.to_q",
        "output_blocks_2_1_transformer_blocks_0_attn2_to_v": "up_blocks.0.attentions.2.transformer_blocks.0.attn2.to_v",
        "middle_block_1_transformer_blocks_1_attn1_to_k": "mid_block.attentions.0.transformer_blocks.1.attn1.to_k",
    }
    modules = dict(unet.named_modules())
    tensors = {}
    for flat, path in names.items():
        linear = modules[path]
        tensors[f"lora_unet_{flat}.lora_down.weight"] = torch.randn(4, linear.in_features)
        tensors[f"lora_unet_{flat}.lora_up.weight"] = torch.randn(linear.out_features, 4)
        tensors[f"lora_unet_{flat}.alpha"] = torch.tensor(4.0)
    file = kohya(tmp_path, tensors, "sgm.safetensors")
    weights = read_lora(file, unet_config=unet.config)
    assert weights.modules == sorted(names.values())
    for flat, path in names.items():
        assert torch.equal(weights.state[f"{path}.lora_A.weight"], tensors[f"lora_unet_{flat}.lora_down.weight"])


# ----------------------------------------------------------------------------------------------------------- SD3


def test_sd3_kohya_round_trip_and_what_diffusers_reads(tmp_path, sd3_policy):
    sd3_policy.save_lora_weights(tmp_path / "final")
    ours = read_lora(tmp_path / "final")
    assert ours.layout is LAYOUTS["sd3"] and ours.component == "transformer"
    file = export(str(tmp_path / "final"), str(tmp_path / "sd3.safetensors"))
    with safetensors.safe_open(str(file), framework="pt") as f:
        keys = list(f.keys())
    assert all(k.startswith("lora_transformer_transformer_blocks_") for k in keys)
    assert "lora_transformer_transformer_blocks_0_attn_to_add_out.lora_up.weight" in keys
    back = read_lora(file)
    assert same_tensors(back.state, ours.state) and back.settings == ours.settings

    # diffusers 0.42 has no SD3 kohya reader: load_lora_weights warns and adds no adapter
    pipe = StableDiffusion3Pipeline.from_pretrained(asset_path("tiny_sd3"), text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(str(file))
    assert not getattr(pipe.transformer, "peft_config", None)
    # its diffusers-format file (diffalign's own, and --format diffusers of the kohya file) loads and matches
    export(str(file), str(tmp_path / "sd3-diffusers"), fmt="diffusers")
    pipe.load_lora_weights(str(tmp_path / "sd3-diffusers"))
    g = torch.Generator().manual_seed(0)
    x, text, pooled = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 8, 128, generator=g), torch.randn(2, 64)
    with torch.no_grad():
        got = pipe.transformer(x, text, pooled, torch.tensor([10.0, 700.0])).sample
        want = sd3_policy.transformer(x, text, pooled, torch.tensor([10.0, 700.0])).sample
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def sd35_medium_meta():
    """SD3.5-Medium's transformer (published config: 24 layers, 24 heads of 64, dual attention in layers 0-12, RMS QK
    norm) on the meta device: its module names, no memory."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel

    with init_empty_weights(include_buffers=True):
        return SD3Transformer2DModel(sample_size=128, patch_size=2, in_channels=16, num_layers=24,
                                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                                     caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
                                     pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                                     qk_norm="rms_norm")


def test_sd3_kohya_names_map_back_to_every_linear_module_of_sd35_medium():
    model = sd35_medium_meta()
    assert module_vocabulary(model) <= sd3_vocabulary()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    # per block: AdaLN linears 2, joint attention 8, feed-forwards 2 + 2; dual-attention blocks (0-12) add attn2's 4;
    # the last block has no context output (no to_add_out, no ff_context): 13·18 + 10·14 + 11, plus the time/text
    # embedders 4, context_embedder, norm_out.linear and proj_out
    assert len(linear) == 13 * 18 + 10 * 14 + 11 + 4 + 3
    for name in linear:
        assert unflatten_module_name(name.replace(".", "_"), sd3_vocabulary()) == name


def test_kohya_sd_scripts_sd3_names_are_refused_with_the_reason(tmp_path):
    file = tmp_path / "sd-scripts-sd3.safetensors"
    safetensors.torch.save_file({"lora_transformer_joint_blocks_0_x_block_attn_qkv.lora_down.weight": torch.zeros(4, 8),
                                 "lora_transformer_joint_blocks_0_x_block_attn_qkv.lora_up.weight": torch.zeros(24, 4)},
                                str(file))
    with pytest.raises(ValueError, match="joint_blocks.*fused qkv"):
        read_lora(file)


# ------------------------------------------------------------------------------------------- files it does not read


def kohya(tmp_path, tensors: dict, name="x.safetensors"):
    safetensors.torch.save_file(tensors, str(tmp_path / name))
    return tmp_path / name


MODULE = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"


@pytest.mark.parametrize("tensors,match", [
    ({f"{MODULE}.lora_down.weight": torch.zeros(4, 8), f"{MODULE}.lora_up.weight": torch.zeros(8, 4),
      "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8),
      "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4)}, "text-encoder"),
    ({f"{MODULE}.lora_down.weight": torch.zeros(4, 8), f"{MODULE}.lora_up.weight": torch.zeros(8, 4),
      f"{MODULE}.dora_scale": torch.zeros(1, 8)}, "DoRA"),
    ({f"{MODULE}.hada_w1_a": torch.zeros(4, 8)}, "LoHa"),
    ({f"{MODULE}.lora_down.weight": torch.zeros(4, 8), f"{MODULE}.lora_up.weight": torch.zeros(8, 4),
      f"{MODULE.replace('to_q', 'to_k')}.lora_down.weight": torch.zeros(2, 8),
      f"{MODULE.replace('to_q', 'to_k')}.lora_up.weight": torch.zeros(8, 2)}, "2 different LoRA ranks"),
    ({f"{MODULE}.lora_down.weight": torch.zeros(4, 8), f"{MODULE}.lora_up.weight": torch.zeros(8, 4),
      f"{MODULE}.alpha": torch.tensor(4.0), f"{MODULE.replace('to_q', 'to_k')}.lora_down.weight": torch.zeros(4, 8),
      f"{MODULE.replace('to_q', 'to_k')}.lora_up.weight": torch.zeros(8, 4),
      f"{MODULE.replace('to_q', 'to_k')}.alpha": torch.tensor(1.0)}, "different LoRA alphas"),
    ({f"{MODULE}.lora_down.weight": torch.zeros(4, 8)}, "lacks lora_down or lora_up"),
    ({"unet.conv_in.weight": torch.zeros(4, 4, 3, 3)}, "not LoRA matrices"),
    ({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4)}, "neither a kohya LoRA"),
    ({"text_encoder.text_model.encoder.layers.0.mlp.fc1.lora.down.weight": torch.zeros(4, 8)}, "text-encoder"),
])
def test_files_that_are_not_a_denoiser_lora_are_refused_naming_the_field(tmp_path, tensors, match):
    with pytest.raises(ValueError, match=f"model.init_lora: .*{match}"):
        read_lora(kohya(tmp_path, tensors), field_name="model.init_lora")


def test_paths_that_are_not_lora_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.init_lora=.*does not exist"):
        read_lora(tmp_path / "missing.safetensors", field_name="model.init_lora")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "lora.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"without pytorch_lora_weights.safetensors. It holds \['lora"):
        read_lora(tmp_path / "folder", field_name="model.init_lora")
    (tmp_path / "lora.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .safetensors file"):
        read_lora(tmp_path / "lora.bin", field_name="model.init_lora")
    whole = kohya(tmp_path, {f"{MODULE}.lora_down.weight": torch.zeros(4, 8),
                             f"{MODULE}.lora_up.weight": torch.zeros(8, 4)})
    (tmp_path / "cut.safetensors").write_bytes(whole.read_bytes()[:-20])
    with pytest.raises(ValueError, match="cannot be read"):
        read_lora(tmp_path / "cut.safetensors", field_name="model.init_lora")


def test_kohya_alpha_defaults_to_the_rank_and_metadata_restores_targets(tmp_path):
    file = kohya(tmp_path, {f"{MODULE}.lora_down.weight": torch.ones(4, 8), f"{MODULE}.lora_up.weight": torch.ones(8, 4)})
    weights = read_lora(file)
    assert (weights.rank, weights.alpha) == (4, 4.0)  # kohya: no .alpha means alpha = dim (scale 1)
    assert weights.target_modules == ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"]
    safetensors.torch.save_file(safetensors.torch.load_file(file), str(file),
                                metadata={"diffalign_lora_config": json.dumps({"r": 4, "lora_alpha": 4,
                                                                               "target_modules": ["to_q"]})})
    assert read_lora(file).target_modules == ["to_q"]


# ----------------------------------------------------------------------------------------------------- the command


def test_export_command_errors(tmp_path, sd_policy, sd3_policy, capsys):
    sd_policy.save_lora_weights(tmp_path / "final")
    main([str(tmp_path / "final"), str(tmp_path / "a.safetensors")])
    assert "wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exists; pass --overwrite"):
        main([str(tmp_path / "final"), str(tmp_path / "a.safetensors")])
    main([str(tmp_path / "final"), str(tmp_path / "a.safetensors"), "--overwrite"])
    with pytest.raises(SystemExit, match="must be a .safetensors file name"):
        main([str(tmp_path / "final"), str(tmp_path / "a.ckpt")])
    with pytest.raises(SystemExit, match="--family sd3 is a transformer family"):
        main([str(tmp_path / "final"), str(tmp_path / "b.safetensors"), "--family", "sd3"])
    with pytest.raises(SystemExit, match="does not exist"):
        main([str(tmp_path / "nothing"), str(tmp_path / "c.safetensors")])
    # a transformer LoRA of another family (Wan's block names) exports to diffusers format only
    wan = tmp_path / "wan"
    wan.mkdir()
    safetensors.torch.save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 8),
                                 "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(8, 4)},
                                str(wan / "pytorch_lora_weights.safetensors"))
    with pytest.raises(SystemExit, match="use --format diffusers"):
        main([str(wan), str(tmp_path / "wan.safetensors")])
    assert math.isclose(read_lora(tmp_path / "a.safetensors").alpha, 2.0)
