"""The tiny world's pretraining script runs end to end on a tiny budget and writes loadable models."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script, same_state

ROOT = Path(__file__).resolve().parents[2]


def _main(args: list[str], monkeypatch, capsys) -> str:
    """``scripts/pretrain_tiny_world.py <args>`` in this process (its ``main``; a child's start is not what the run is
    checked for): what it printed."""
    script = load_script("pretrain_tiny_world")
    monkeypatch.setattr(sys, "argv", ["pretrain_tiny_world.py", *args])
    capsys.readouterr()
    script.main()
    return capsys.readouterr().out


@pytest.mark.slow
def test_pretrain_script_runs_a_few_steps(tmp_path, monkeypatch, capsys):
    from diffusers import StableDiffusionPipeline

    from diffalign.rewards.tiny_clip import build_tiny_clip

    _main(["all", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--vae-steps", "2", "--unet-steps",
           "2", "--unet-batch", "4", "--clip-steps", "2", "--num-latents", "16", "--eval-images", "8", "--threads", "1",
           "--flow-steps", "2", "--flow-eval-prompts", "2", "--flow-width", "32", "--flow-layers", "1", "--flux-steps",
           "2", "--flux-eval-prompts", "2", "--flux-heads", "2"], monkeypatch, capsys)
    metrics = json.loads((tmp_path / "out" / "pretrain_metrics.json").read_text())
    assert set(metrics) == {"vae_metrics", "unet_metrics", "clip_metrics", "flow_metrics", "flux_metrics"}
    assert metrics["unet_metrics"]["steps"] == 2
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "out" / "tiny_sd")
    images = pipe(["a red circle"], num_inference_steps=2, output_type="pt",
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 32, 32)
    from diffusers import StableDiffusion3Pipeline

    flow = StableDiffusion3Pipeline.from_pretrained(tmp_path / "out" / "tiny_sd3", text_encoder_3=None,
                                                    tokenizer_3=None)
    images = flow(["a red circle"], num_inference_steps=2, output_type="pt", max_sequence_length=8,
                  generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 32, 32)
    clip = build_tiny_clip(str(tmp_path / "out" / "tiny_clip" / "open_clip_model.safetensors"))
    assert clip.encode_image(torch.zeros(1, 3, 32, 32)).shape == (1, 64)
    from diffusers import AutoencoderKL, FluxPipeline

    vae = AutoencoderKL.from_pretrained(tmp_path / "out" / "tiny_sd3" / "vae", torch_dtype=torch.float32)
    flux = FluxPipeline.from_pretrained(tmp_path / "out" / "tiny_flux", vae=vae, torch_dtype=torch.float32)
    assert not flux.transformer.config.guidance_embeds and not (tmp_path / "out" / "tiny_flux" / "vae").exists()
    images = flux(["a red circle"], negative_prompt=[""], true_cfg_scale=4.5, num_inference_steps=2, height=32,
                  width=32, max_sequence_length=12, output_type="pt", generator=torch.Generator().manual_seed(0)).images
    assert images.shape == (1, 3, 32, 32)


@pytest.mark.slow
def test_flux_stage_interrupted_and_resumed_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path, monkeypatch,
                                                                                      capsys):
    """Five steps in one go against two, a checkpoint, a new process with --resume, three more (an EMA evaluation at
    step 3 in between): the step-5 checkpoints hold identical weights, EMA, optimizer, LR schedule, RNG states."""
    from diffalign.config.compose import asset_path

    shutil.copytree(Path(asset_path("tiny_sd3")) / "vae", tmp_path / "out" / "tiny_sd3" / "vae")
    base = [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), "flux", "--out", str(tmp_path / "out"),
            "--num-latents", "16", "--unet-batch", "4", "--flux-steps", "5", "--flux-heads", "2",
            "--flux-eval-every", "3", "--flux-eval-prompts", "2", "--threads", "1"]

    def run(*extra):
        res = subprocess.run(base + list(extra), check=False, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    # the uninterrupted run and the first half in this process, the resumed half in a new one
    _main(base[2:] + ["--work", str(tmp_path / "a"), "--flux-stop-at", "5"], monkeypatch, capsys)
    assert "stopped at step 2" in _main(base[2:] + ["--work", str(tmp_path / "b"), "--flux-stop-at", "2"],
                                        monkeypatch, capsys)
    at_2 = torch.load(tmp_path / "b" / "flux_checkpoint.pt", weights_only=False)
    assert "resumed from" in run("--work", str(tmp_path / "b"), "--flux-stop-at", "5", "--resume")
    a = torch.load(tmp_path / "a" / "flux_checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "flux_checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 5 and at_2["step"] == 2
    assert [e["step"] for e in a["evals"]] == [e["step"] for e in b["evals"]] == [3]
    for key in set(a) - {"elapsed"}:
        assert same_state(a[key], b[key]), key
    # the resumed half did train: every weight tensor moved between steps 2 and 5
    for before, after in zip(at_2["modules"], b["modules"]):
        for name, value in after.items():
            if value.is_floating_point() and "position_ids" not in name:
                assert not torch.equal(before[name], value), name
    assert not (tmp_path / "out" / "tiny_flux").exists()  # a stopped run ships nothing


@pytest.mark.slow
def test_flow2_stage_resumes_bit_for_bit_and_saves_a_loadable_ema_pipeline(tmp_path, monkeypatch, capsys):
    """The stronger SD3-format base's stage (flow2): five steps in one go against two, a checkpoint, a new process with
    --resume, three more (an EMA evaluation and save at step 3 in between) give identical step-5 checkpoints; the
    saved EMA folder loads as a `model=tiny_sd3` policy (what the fragility gate runs on)."""
    from diffalign.config.compose import asset_path
    from diffalign.models.sd3 import StableDiffusion3Policy

    shutil.copytree(Path(asset_path("tiny_sd3")) / "vae", tmp_path / "out" / "tiny_sd3" / "vae")
    base = [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), "flow2", "--out", str(tmp_path / "out"),
            "--num-latents", "16", "--unet-batch", "4", "--flow2-steps", "5", "--flow2-width", "32",
            "--flow2-layers", "1", "--flow2-eval-every", "3", "--flow2-eval-prompts", "2", "--threads", "1"]

    def run(*extra):
        res = subprocess.run(base + list(extra), check=False, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    # the uninterrupted run and the first half in this process, the resumed half in a new one
    _main(base[2:] + ["--work", str(tmp_path / "a"), "--flow2-stop-at", "5"], monkeypatch, capsys)
    assert "stopped at step 2" in _main(base[2:] + ["--work", str(tmp_path / "b"), "--flow2-stop-at", "2"],
                                        monkeypatch, capsys)
    at_2 = torch.load(tmp_path / "b" / "flow2_checkpoint.pt", weights_only=False)
    assert "resumed from" in run("--work", str(tmp_path / "b"), "--flow2-stop-at", "5", "--resume")
    a = torch.load(tmp_path / "a" / "flow2_checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "flow2_checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 5 and at_2["step"] == 2
    assert [e["step"] for e in a["evals"]] == [e["step"] for e in b["evals"]] == [3]
    for key in set(a) - {"elapsed"}:
        assert same_state(a[key], b[key]), key
    for before, after in zip(at_2["modules"], b["modules"]):
        for name, value in after.items():
            if value.is_floating_point() and "position_ids" not in name:
                assert not torch.equal(before[name], value), name
    # the step-3 EMA save: a pipeline folder the shipped tiny_sd3 config loads
    policy = StableDiffusion3Policy.from_pretrained(str(tmp_path / "b" / "tiny_sd3_wide"), load_t5=False,
                                                    max_sequence_length=8, lora_rank=4)
    assert policy.denoiser.config.num_layers == 1
    assert not (tmp_path / "out" / "tiny_sd3_wide").exists()  # nothing is shipped


@pytest.mark.slow
def test_flux2_stage_resumes_bit_for_bit_and_its_ema_export_loads_as_model_tiny_flux(tmp_path, monkeypatch, capsys):
    """The stronger FLUX-format base's stage (flux2, the loop flow2 runs): five steps in one go against three (with an
    EMA evaluation and export at step 3), a checkpoint, a new process with --resume, two more give identical step-5
    checkpoints, edge-weighted loss included. The step-3 export holds the checkpoint's EMA weights rounded to float16,
    has no VAE of its own, and ``model=tiny_flux model.pretrained_model_name_or_path=<export>`` loads it with the VAE
    the stage trained on (tiny_sd3's)."""
    from conftest import compose_cfg
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from hydra.utils import instantiate

    from diffalign.config.compose import asset_path
    from diffalign.lora.initial import model_config

    shutil.copytree(Path(asset_path("tiny_sd3")) / "vae", tmp_path / "out" / "tiny_sd3" / "vae")
    base = [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), "flux2", "--out", str(tmp_path / "out"),
            "--num-latents", "16", "--unet-batch", "4", "--flux2-steps", "5", "--flux2-heads", "2", "--flux2-layers",
            "1", "--flux2-single-layers", "1", "--flux2-eval-every", "3", "--flux2-eval-prompts", "2",
            "--flux2-edge-weight", "3", "--threads", "1"]

    def run(*extra):
        res = subprocess.run(base + list(extra), check=False, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    _main(base[2:] + ["--work", str(tmp_path / "a"), "--flux2-stop-at", "5"], monkeypatch, capsys)
    out = _main(base[2:] + ["--work", str(tmp_path / "b"), "--flux2-stop-at", "3"], monkeypatch, capsys)
    assert "edge weight 3.0:" in out and "flux2 step 3 EMA held-out verifier accuracy" in out
    assert "stopped at step 3" in out
    at_3 = torch.load(tmp_path / "b" / "flux2_checkpoint.pt", weights_only=False)
    export = tmp_path / "b" / "tiny_flux_wide"
    assert not (export / "vae").exists()
    # the export is the step-3 EMA (the checkpoint's shadow weights, in parameters() order), as float16 files
    saved = FluxTransformer2DModel.from_pretrained(export / "transformer")
    assert saved.config.num_layers == 1 and saved.config.num_single_layers == 1 and not saved.config.guidance_embeds
    names = [n for n, _ in saved.named_parameters()]
    shadow = dict(zip(names, at_3["emas"][0]["shadow_params"]))
    for name, value in saved.named_parameters():
        assert torch.equal(value, shadow[name].to(torch.float16).to(torch.float32)), name
    # model=tiny_flux loads the export, with the VAE of the config (tiny_sd3's, the one the stage trained on)
    cfg = compose_cfg([f"output_dir={tmp_path}", "model=tiny_flux", f"model.pretrained_model_name_or_path={export}"])
    policy = instantiate(model_config(cfg.model))
    loaded = {k.replace(".base_layer", ""): v for k, v in policy.pipe.transformer.state_dict().items() if "lora_" not in k}
    assert loaded.keys() == dict(saved.named_parameters()).keys()
    assert all(torch.equal(loaded[n], v) for n, v in saved.named_parameters())
    trained_vae = AutoencoderKL.from_pretrained(tmp_path / "out" / "tiny_sd3" / "vae", torch_dtype=torch.float32)
    assert same_state(policy.pipe.vae.state_dict(), trained_vae.state_dict())
    # the resumed half: a new process, steps 4-5, the same checkpoint as the uninterrupted run
    assert "resumed from" in run("--work", str(tmp_path / "b"), "--flux2-stop-at", "5", "--resume")
    a = torch.load(tmp_path / "a" / "flux2_checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "flux2_checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 5 and a["sizes"]["edge_weight"] == 3.0
    assert [e["step"] for e in a["evals"]] == [e["step"] for e in b["evals"]] == [3]
    for key in set(a) - {"elapsed"}:
        assert same_state(a[key], b[key]), key
    for before, after in zip(at_3["modules"], b["modules"]):
        for name, value in after.items():
            if value.is_floating_point() and "position_ids" not in name:
                assert not torch.equal(before[name], value), name
    assert not (tmp_path / "out" / "tiny_flux_wide").exists()  # nothing is shipped


def _script():
    return load_script("pretrain_tiny_world")


def test_edge_blocks_of_a_square_and_of_the_flow2_renders():
    """A 5x5 square at rows/cols 10-14: its edge pixels (one pixel either side of the boundary) span rows/cols 9-15,
    i.e. the 4x4 blocks 2 and 3 of each axis — and nothing else. The flow2 edge blocks are those of the very renders
    `render_batch` draws for `encode_train_latents` (seed 1 + chunk start, past the first 256-render chunk)."""
    import numpy as np

    from diffalign.world.prompts import sample_train_specs
    from diffalign.world.render import WIDE_MARGINS

    script = _script()
    img = np.zeros((32, 32, 3), np.uint8)
    img[10:15, 10:15] = (220, 40, 40)
    expected = np.zeros((8, 8), bool)
    expected[2:4, 2:4] = True
    assert (script.edge_blocks(img) == expected).all()
    blocks = script.latent_edge_blocks(260, WIDE_MARGINS)
    assert blocks.shape == (260, 1, 8, 8) and blocks.dtype == torch.bool
    specs = sample_train_specs(260, seed=1)
    for chunk in (0, 256):
        renders = script.render_batch(specs[chunk:chunk + 256], seed=1 + chunk, margins=WIDE_MARGINS)
        for j in (0, len(renders) - 1):
            pixels = (renders[j].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            assert (script.edge_blocks(pixels) == blocks[chunk + j, 0].numpy()).all()


@pytest.mark.slow
def test_flow2_edge_weight_is_a_size_of_the_run(tmp_path, monkeypatch, capsys):
    """--flow2-edge-weight trains (two steps), is recorded in the checkpoint's sizes, a resume with another weight is
    refused, and a non-positive weight is refused before any work."""
    shutil.copytree(Path(__import__("diffalign.config.compose", fromlist=["asset_path"]).asset_path("tiny_sd3"))
                    / "vae", tmp_path / "out" / "tiny_sd3" / "vae")
    base = ["flow2", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w"), "--num-latents", "16",
            "--unet-batch", "4", "--flow2-steps", "4", "--flow2-width", "32", "--flow2-layers", "1",
            "--flow2-eval-every", "0", "--threads", "1"]
    out = _main(base + ["--flow2-edge-weight", "3", "--flow2-stop-at", "2"], monkeypatch, capsys)
    assert "edge weight 3.0:" in out and "stopped at step 2" in out
    ckpt = torch.load(tmp_path / "w" / "flow2_checkpoint.pt", weights_only=False)
    assert ckpt["sizes"]["edge_weight"] == 3.0 and math.isfinite(ckpt["running"])
    with pytest.raises(SystemExit, match="edge_weight"):
        _main(base + ["--flow2-edge-weight", "2", "--resume"], monkeypatch, capsys)
    with pytest.raises(SystemExit):
        _main(base + ["--flow2-edge-weight", "0"], monkeypatch, capsys)
    assert "--flow2-edge-weight must be > 0" in capsys.readouterr().err
