"""Malformed LoRA files are refused before any model loads, with one line naming the file, the tensor (or metadata
key) and the reason (issue 32, item 4): shapes, ranks, alphas, dtypes, non-finite values, metadata types, modules the
model lacks, another model's size; ``diffalign-export`` checks the family it is told against the weights and its
destination before writing."""

from __future__ import annotations

import json
import math

import pytest
import safetensors.torch
import torch
from conftest import compose_cfg

from diffalign.lora.export import main as export_main
from diffalign.lora.initial import adopt_init_lora, meta_denoiser
from diffalign.lora.io import read_lora

KOHYA = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
DOWN, UP, ALPHA = f"{KOHYA}.lora_down.weight", f"{KOHYA}.lora_up.weight", f"{KOHYA}.alpha"
GOOD = {DOWN: torch.full((4, 8), 0.1), UP: torch.full((8, 4), 0.1), ALPHA: torch.tensor(2.0)}
PEFT = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
GOOD_DIFFUSERS = {f"{PEFT}.lora_A.weight": torch.full((4, 8), 0.1), f"{PEFT}.lora_B.weight": torch.full((8, 4), 0.1)}


def save(path, tensors: dict, metadata: dict | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return path


def config(**fields) -> dict:
    return {"lora_adapter_metadata": json.dumps({f"unet.{k}": v for k, v in fields.items()})}


NAN = float("nan")
BAD_KOHYA = {  # name: (tensors replacing GOOD's, the reason the message gives)
    "vector alpha": ({ALPHA: torch.tensor([2.0, 2.0])}, rf"tensor '{ALPHA}' is a torch.float32 tensor of shape \(2,\)"),
    "NaN alpha": ({ALPHA: torch.tensor(NAN)}, rf"tensor '{ALPHA}' is alpha = nan"),
    "zero alpha": ({ALPHA: torch.tensor(0.0)}, rf"tensor '{ALPHA}' is alpha = 0; .* > 0"),
    "negative alpha": ({ALPHA: torch.tensor(-1.0)}, rf"tensor '{ALPHA}' is alpha = -1"),
    "NaN weights": ({DOWN: torch.full((4, 8), NAN)}, rf"tensor '{DOWN}' holds 32 non-finite values"),
    "inf weights": ({UP: torch.tensor([[math.inf, 0, 0, 0]] * 8)}, rf"tensor '{UP}' holds 8 non-finite values"),
    "integer weights": ({DOWN: torch.ones(4, 8, dtype=torch.int64)}, rf"tensor '{DOWN}' has dtype torch.int64"),
    "3-D weights": ({DOWN: torch.ones(4, 8, 2)}, rf"tensor '{DOWN}' has shape \(4, 8, 2\); a LoRA matrix is 2-D"),
    "rank 0": ({DOWN: torch.ones(0, 8), UP: torch.ones(8, 0)}, rf"tensor '{DOWN}' has shape \(0, 8\): rank 0"),
    "up of another rank": ({UP: torch.ones(8, 3)}, rf"{KOHYA} has lora_down \(4, 8\) but lora_up \(8, 3\)"),
}


@pytest.mark.parametrize("case", list(BAD_KOHYA))
def test_malformed_kohya_tensors_are_refused_naming_the_file_and_tensor(tmp_path, case):
    """Before: a vector alpha raised RuntimeError, NaN alphas a bare StopIteration, a rank-0 file blamed
    model.lora_rank, and NaN / integer / zero-alpha files were accepted (a NaN init LoRA trained to exit 0)."""
    replaced, reason = BAD_KOHYA[case]
    file = save(tmp_path / "lora.safetensors", {**GOOD, **replaced})
    with pytest.raises(ValueError, match=f"^model.init_lora: {file}: .*{reason}") as caught:
        read_lora(file, field_name="model.init_lora")
    assert "\n" not in str(caught.value)
    read_lora(save(tmp_path / "good.safetensors", GOOD))  # (the file it was made from reads)


BAD_METADATA = {
    "not JSON": ({"lora_adapter_metadata": "{not json"}, "metadata 'lora_adapter_metadata' is not JSON"),
    "a list": ({"lora_adapter_metadata": "[1, 2]"}, "metadata 'lora_adapter_metadata' is a JSON list, not an object"),
    "r a string": (config(r="four", lora_alpha=4), "'r' is 'four' \\(str\\); it must be an integer >= 1"),
    "r a boolean": (config(r=True, lora_alpha=4), "'r' is True \\(bool\\)"),
    "r 0": (config(r=0), "'r' is 0 \\(int\\); it must be an integer >= 1"),
    "alpha a list": (config(r=4, lora_alpha=[4]), "'lora_alpha' is \\[4\\] \\(list\\); it must be a finite number > 0"),
    "alpha negative": (config(r=4, lora_alpha=-2), "'lora_alpha' is -2 \\(int\\)"),
    "alpha NaN": (config(r=4, lora_alpha=NAN), "'lora_alpha' is nan \\(float\\)"),
    "targets a number": (config(r=4, lora_alpha=4, target_modules=3), "'target_modules' is 3 \\(int\\)"),
    "kohya config a string": ({"diffalign_lora_config": '"r=4"'}, "'diffalign_lora_config' is a JSON str"),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_malformed_metadata_is_refused_naming_the_file_and_key(tmp_path, case):
    """Before: a JSONDecodeError, AttributeError or ValueError("invalid literal for int()") naming neither the file nor
    the field, or (a negative alpha) a refusal at load naming model settings the user never set."""
    metadata, reason = BAD_METADATA[case]
    tensors = GOOD if "diffalign_lora_config" in metadata else GOOD_DIFFUSERS
    file = save(tmp_path / "run" / "final" / "pytorch_lora_weights.safetensors", tensors, metadata)
    with pytest.raises(ValueError, match=f"^checkpoint: {file}: .*{reason}") as caught:
        read_lora(file.parent, field_name="checkpoint")
    assert "\n" not in str(caught.value)


# --------------------------------------------------------------------------------- against the model, before it loads


@pytest.fixture
def no_model_loading(monkeypatch):
    import diffusers

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained", refuse)


def tiny_sd_lora(folder, widen: int = 1, rename: tuple[str, str] | None = None):
    """A rank-2 diffusers LoRA on tiny_sd's attn1.to_q / attn2.to_k modules, shaped from the model's own config (built
    on the meta device), the first one's input width times `widen`, its module paths renamed by `rename`."""
    cfg = compose_cfg(["model=tiny_sd"])
    modules = dict(meta_denoiser(cfg).named_modules())
    names = sorted(n for n in modules if n.endswith(("attn1.to_q", "attn2.to_k")))[:2]
    tensors = {}
    for k, name in enumerate(names):
        layer = modules[name]
        path = name.replace(*rename) if rename else name
        tensors[f"unet.{path}.lora_A.weight"] = torch.full((2, layer.in_features * (widen if k == 0 else 1)), 0.1)
        tensors[f"unet.{path}.lora_B.weight"] = torch.full((layer.out_features, 2), 0.1)
    return save(folder / "pytorch_lora_weights.safetensors", tensors).parent


def init_cfg(tmp_path, lora):
    return compose_cfg([f"output_dir={tmp_path / 'run'}", "model=tiny_sd", "method=diffusion_dpo_tiny",
                        "data=shapes_pairs", f"model.init_lora={lora}"])


def test_a_lora_that_fits_the_model_is_adopted(tmp_path, no_model_loading):
    """The control: built from the model's shapes, it is accepted (rank 2, alpha = rank without metadata)."""
    adopted = adopt_init_lora(init_cfg(tmp_path, tiny_sd_lora(tmp_path / "fits")))
    assert (adopted["lora_rank"], adopted["lora_alpha"]) == (2, 2)


def test_modules_the_model_lacks_are_refused_before_it_loads(tmp_path, no_model_loading):
    """Before: accepted here, then peft's "Target modules ... not found" inside Hydra's "Error in call to target"."""
    lora = tiny_sd_lora(tmp_path / "renamed", rename=("down_blocks.", "down_blocks.7"))
    with pytest.raises(ValueError, match=r"^model.init_lora: .*: module 'down_blocks.7.* is not in the model .*tiny_sd's "
                                         r"UNet2DConditionModel: the LoRA is for another model; use a LoRA trained"):
        adopt_init_lora(init_cfg(tmp_path, lora))


def test_a_lora_of_another_model_size_is_refused_before_it_loads(tmp_path, no_model_loading):
    """Before: the model loaded first, then the shapes were compared."""
    lora = tiny_sd_lora(tmp_path / "wide", widen=2)
    with pytest.raises(ValueError, match=r"^model.init_lora: .*: tensors .*lora_A/B are \(2, \d+\) / \(\d+, 2\) but the "
                                         r"model .*is Linear\(\d+ → \d+\): the LoRA is for another model size"):
        adopt_init_lora(init_cfg(tmp_path, lora))


def test_a_model_without_a_local_folder_names_the_missing_module_at_load(tmp_path):
    """A randomly initialised model (no folder to read its config from) is checked as it is built and when the LoRA
    is loaded into it: the message says the LoRA is for another model. Before: peft's NoMatchingPeftModuleError inside
    Hydra's "Error in call to target" when no module matched, and when some did, "adapts other modules than the
    policy's adapter" with the advice to set model.lora_target_modules, which the user never set."""
    from diffalign.lora.initial import build_policy

    lora = tiny_sd_lora(tmp_path / "renamed", rename=("down_blocks.", "down_blocks.7"))
    cfg = compose_cfg([f"output_dir={tmp_path / 'run'}", "model=tiny_random", "method=diffusion_dpo_tiny",
                       "data=shapes_pairs", f"model.init_lora={lora}"])
    with pytest.raises(ValueError, match=r"^model.init_lora: .*: the model \(.*build_tiny_random_policy\) has none of "
                                         r"the modules the LoRA adapts \(e.g. \['down_blocks.7.*'\]\): the LoRA is for "
                                         r"another model; use a LoRA trained on this model"):
        build_policy(cfg, log=lambda line: None)
    partly = tiny_sd_lora(tmp_path / "partly", rename=("attn1", "attn9"))  # one module of two renamed
    cfg = compose_cfg([f"output_dir={tmp_path / 'run2'}", "model=tiny_random", "method=diffusion_dpo_tiny",
                       "data=shapes_pairs", f"model.init_lora={partly}"])
    with pytest.raises(ValueError, match=r"^model.init_lora: .*: module '.*attn9.to_q' \(and 0 more\) is not in this "
                                         r"model's UNet2DConditionModel: the LoRA is for another model; use a LoRA"):
        build_policy(cfg, log=lambda line: None)


def test_a_nan_init_lora_is_refused_before_training(tmp_path, no_model_loading):
    """Before: a NaN init LoRA trained to exit code 0 and was exported as a NaN file."""
    lora = tiny_sd_lora(tmp_path / "nan")
    tensors = safetensors.torch.load_file(lora / "pytorch_lora_weights.safetensors")
    key = min(tensors)
    tensors[key][0, 0] = NAN
    save(lora / "pytorch_lora_weights.safetensors", tensors)
    with pytest.raises(ValueError, match=rf"^model.init_lora: .*: tensor '{key}' holds 1 non-finite values"):
        adopt_init_lora(init_cfg(tmp_path, lora))
    with pytest.raises(SystemExit, match="diffalign-export: error: source: .* holds 1 non-finite values"):
        export_main([str(lora), str(tmp_path / "out.safetensors")])
    assert not (tmp_path / "out.safetensors").exists()


def test_eval_refuses_a_lora_of_another_size_before_sampling_the_base(tmp_path, no_model_loading):
    """Before: ``diffalign-eval`` sampled and scored the base model, then failed loading the checkpoint."""
    from diffalign.cli import _eval_main

    lora = tiny_sd_lora(tmp_path / "wide", widen=2)
    cfg = compose_cfg([f"checkpoint={lora}", f"output_dir={tmp_path / 'ev'}", "model=tiny_sd"], name="evaluate")
    with pytest.raises(SystemExit, match=r"^diffalign: error: checkpoint: .*the LoRA is for another model size"):
        _eval_main(cfg)
    assert not (tmp_path / "ev" / "samples.jsonl").exists()


# ---------------------------------------------------------------------------------------------------------- export


def unet_lora(path, width: int):
    """A UNet LoRA whose cross-attention key takes `width` inputs (SD1.x 768, SD2.x 1024, SDXL 2048)."""
    module = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k"
    return save(path, {f"{module}.lora_A.weight": torch.full((2, width), 0.1),
                       f"{module}.lora_B.weight": torch.full((640, 2), 0.1)})


def test_export_checks_the_family_it_is_told_against_the_weights(tmp_path):
    """Before: ``--family sdxl`` wrote an SD1.x LoRA labelled SDXL (ss_base_model_version sdxl_base_v1-0)."""
    sd1 = unet_lora(tmp_path / "sd1.safetensors", 768)
    with pytest.raises(SystemExit, match=r"--family sdxl: .* is not an sdxl LoRA: its tensor .*attn2.to_k.lora_A.weight "
                                         r"takes 768 inputs, sdxl's cross-attention width is 2048 \(sd1 has 768\); "
                                         r"pass --family sd1"):
        export_main([str(sd1), str(tmp_path / "x.safetensors"), "--family", "sdxl"])
    with pytest.raises(SystemExit, match="--family sd2: .* takes 768 inputs"):
        export_main([str(sd1), str(tmp_path / "x"), "--format", "diffusers", "--family", "sd2"])
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x").exists()
    export_main([str(sd1), str(tmp_path / "x.safetensors"), "--family", "sd1"])  # the right one is written
    with safetensors.safe_open(str(tmp_path / "x.safetensors"), "pt") as handle:
        assert handle.metadata()["ss_base_model_version"] == "sd_v1"
    sdxl = unet_lora(tmp_path / "sdxl.safetensors", 2048)
    export_main([str(sdxl), str(tmp_path / "y.safetensors"), "--family", "sdxl"])
    wan = save(tmp_path / "wan.safetensors", {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 8),
                                              "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.ones(8, 2)})
    with pytest.raises(SystemExit, match="--family sd3: .* does not adapt SD3's transformer blocks"):
        export_main([str(wan), str(tmp_path / "w.safetensors"), "--family", "sd3"])


def test_export_destinations_are_checked_before_writing(tmp_path, capsys):
    """Before: a folder named like the file (with --overwrite) and a folder that cannot be written gave raw
    IsADirectoryError / OSError tracebacks."""
    source = unet_lora(tmp_path / "sd1.safetensors", 768)
    (tmp_path / "taken.safetensors").mkdir()
    (tmp_path / "a_file").write_text("x")
    cases = [
        (["taken.safetensors", "--overwrite"], "the kohya destination '.*taken.safetensors' is a folder; pass a file"),
        (["a_file", "--format", "diffusers"], "the diffusers destination '.*a_file' is a file; pass a folder"),
        (["a_file/sub/x.safetensors"], "cannot write '.*x.safetensors': .*a_file is a file, not a folder"),
    ]
    for args, match in cases:
        destination = str(tmp_path / args[0])
        with pytest.raises(SystemExit, match=f"^diffalign-export: error: {match}"):
            export_main([str(source), destination, *args[1:]])
    # a folder no file can be created in (/proc refuses even root, which a chmod 0555 folder does not)
    with pytest.raises(SystemExit, match=r"^diffalign-export: error: cannot write '/proc/x.safetensors': /proc is not "
                                         r"writable \(.*\); pass a destination in a folder you can write"):
        export_main([str(source), "/proc/x.safetensors"])
    with pytest.raises(SystemExit, match=r"cannot write '/proc/lora': /proc is not writable"):
        export_main([str(source), "/proc/lora", "--format", "diffusers"])
