"""The tiny world's pretraining script runs end to end on a tiny budget and writes loadable models."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pretrain_script_runs_a_few_steps(tmp_path):
    from diffusers import StableDiffusionPipeline

    from diffalign.rewards.tiny_clip import build_tiny_clip

    cmd = [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), "all", "--work", str(tmp_path / "w"),
           "--out", str(tmp_path / "out"), "--vae-steps", "2", "--unet-steps", "2", "--unet-batch", "4",
           "--clip-steps", "2", "--num-latents", "16", "--eval-images", "8", "--threads", "1", "--flow-steps", "2",
           "--flow-eval-prompts", "2", "--flow-width", "32", "--flow-layers", "1"]
    res = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "pretrain_metrics.json").read_text())
    assert set(metrics) == {"vae_metrics", "unet_metrics", "clip_metrics", "flow_metrics"}
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
