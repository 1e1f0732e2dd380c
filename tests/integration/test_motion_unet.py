"""The AnimateDiff-style tiny video base (`scripts/pretrain_tiny_video.py --inflate --arch motion`, issue 17 item 6):
diffusers' `UNetMotionModel` built from the shipped tiny image UNet, and `TextToVideoPolicy` running it unchanged
(docs/results/video.md, "Why the direction of motion is not learned")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script
from diffusers import DDIMScheduler, UNet2DConditionModel, UNetMotionModel

from diffalign.config.compose import asset_path
from diffalign.models.text_to_video import TextToVideoPolicy
from diffalign.models.tiny_random import SD15_SCHEDULER_CONFIG
from diffalign.world.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _script():
    return load_script("pretrain_tiny_video")


@pytest.fixture(scope="module")
def motion():
    """(UNetMotionModel inflated from the shipped image UNet, its text encoder, the image UNet2DConditionModel)."""
    tokenizer = build_tokenizer(video=True)
    unet, text_encoder, image_names = _script().inflate_motion_model(Path(asset_path("tiny_sd")), tokenizer)
    image = UNet2DConditionModel.from_pretrained(Path(asset_path("tiny_sd")) / "unet")
    return unet.eval(), text_encoder.eval(), image.eval(), image_names, tokenizer


def _policy(unet, text_encoder, tokenizer, num_frames=8):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(Path(asset_path("tiny_sd")) / "vae")
    return TextToVideoPolicy(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                             scheduler=DDIMScheduler.from_config(SD15_SCHEDULER_CONFIG), num_frames=num_frames,
                             lora_rank=None)


def test_inflated_motion_unet_is_the_image_unet_per_frame_at_step_0(motion):
    """Every image weight is copied and every motion module's output projection is zero, so the residual motion
    modules add nothing: the video output equals the image UNet run on each frame alone (same t and text)."""
    unet, _, image, image_names, _ = motion
    source = image.state_dict()
    target = unet.state_dict()
    assert len(image_names) == len(source)  # every image tensor has its place (names are the same in both layouts)
    assert all(torch.equal(source[k], target[k]) for k in image_names)
    zeroed = [m for n, m in unet.named_modules() if ".motion_modules." in n and n.endswith("proj_out")]
    assert len(zeroed) == 7  # down 1 + 1, mid 1, up 2 + 2 (layers_per_block + 1 per up block)
    assert all(m.weight.abs().max() == 0 and m.bias.abs().max() == 0 for m in zeroed)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, 8, generator=g)
    t = torch.tensor([700, 40])
    text = torch.randn(2, 16, 64, generator=g)
    with torch.no_grad():
        video = UNetMotionModel.forward(unet, x, t, text.repeat_interleave(8, dim=0)).sample
        frames = image(x.permute(0, 2, 1, 3, 4).reshape(16, 4, 8, 8), t.repeat_interleave(8),
                       text.repeat_interleave(8, dim=0)).sample
    torch.testing.assert_close(video, frames.reshape(2, 8, 4, 8, 8).permute(0, 2, 1, 3, 4), rtol=0, atol=1e-5)


def test_frame_positions_are_what_breaks_time_symmetry(motion):
    """Temporal self-attention without positions is permutation-equivariant over frames, so reversing the input
    frames reverses the output exactly; with AnimateDiff's sinusoidal frame positions it does not (the arrow of time
    diffusers' UNet3D's position-free temporal attentions lack, docs/methods/vipo.md)."""
    unet, _, _, _, _ = motion
    unet = UNetMotionModel.from_config(unet.config)
    unet.load_state_dict(motion[0].state_dict())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, m in unet.named_modules():
            if ".motion_modules." in n and n.endswith("proj_out"):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.3)
    blocks = [m for n, m in unet.named_modules() if ".motion_modules." in n and n.endswith("transformer_blocks.0")]
    assert all(b.pos_embed.pe.shape[1] == 8 for b in blocks)  # motion_max_seq_length = the 8 frames
    x = torch.randn(1, 4, 8, 8, 8, generator=g)
    t = torch.tensor([500])
    text = torch.randn(1, 16, 64, generator=g).repeat_interleave(8, dim=0)  # the same text state for every frame

    def reversal_error():
        with torch.no_grad():
            fwd = unet(x, t, text).sample
            rev = unet(x.flip(2), t, text).sample
        return (rev - fwd.flip(2)).abs().max().item(), fwd.abs().max().item()

    err, scale = reversal_error()
    assert err > 1e-2 * scale
    for b in blocks:
        b.pos_embed = None
    err, scale = reversal_error()
    assert err < 1e-5 * scale


def test_text_to_video_policy_feeds_a_motion_unet_one_text_state_per_video(motion):
    """`TextToVideoSDPipeline` and the policy pass (B, L, D) text states; `AnimateDiffPipeline` passes one per frame
    (B·F, L, D). The policy's prediction equals diffusers' own forward fed per-frame states by hand (CFG as
    uncond + w (cond − uncond)); other row counts and more frames than the motion positions raise."""
    unet, text_encoder, _, _, tokenizer = motion
    unet = UNetMotionModel.from_config(unet.config)  # a fresh instance: the policy changes the class of its UNet
    unet.load_state_dict(motion[0].state_dict())
    policy = _policy(unet, text_encoder, tokenizer)
    assert type(policy.unet).__name__ == "UNetMotionModel" and policy.latent_shape == (4, 8, 8, 8)
    prompts = ["a red circle moving left", "a blue square staying still"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, 8, 8, generator=g)
    with torch.no_grad():
        embeds = policy.encode_prompts(prompts)
        got = policy.predict(x, torch.tensor([600, 600]), embeds, guidance_scale=4.0)
        cond = text_encoder(tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                                      return_tensors="pt").input_ids)[0]
        uncond = text_encoder(tokenizer(["", ""], padding="max_length", max_length=tokenizer.model_max_length,
                                        return_tensors="pt").input_ids)[0]
        out = [UNetMotionModel.forward(policy.unet, x, torch.tensor([600, 600]), e.repeat_interleave(8, dim=0)).sample
               for e in (uncond, cond)]
    torch.testing.assert_close(got, out[0] + 4.0 * (out[1] - out[0]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="one per video"):
        policy.unet(x, torch.tensor([600, 600]), cond[:1])
    with pytest.raises(ValueError, match="motion_max_seq_length"):
        _policy(policy.unet, text_encoder, tokenizer, num_frames=9)


def test_pretrain_script_trains_saves_and_reloads_a_motion_unet(tmp_path, monkeypatch):
    """`--inflate --arch motion` runs end to end (training, the direction probe, the held-out evaluation) and writes a
    `TextToVideoSDPipeline` folder whose UNet is a `UNetMotionModel` that `TextToVideoPolicy.from_pretrained` loads
    (the script's ``main`` run in this process: a child's start is not what is checked)."""
    out = tmp_path / "motion"
    monkeypatch.setattr(sys, "argv", ["pretrain_tiny_video.py", "--inflate", "--arch", "motion", "--steps", "2",
                                      "--batch", "2", "--num-videos", "8", "--eval-seeds", "0", "--eval-prompts", "2",
                                      "--eval-steps", "2", "--out", str(out)])
    monkeypatch.chdir(REPO)
    _script().main()
    metrics = json.loads((out / "pretrain_metrics.json").read_text())
    assert metrics["args"]["arch"] == "motion" and metrics["heldout"]["n"] == 2
    assert json.loads((out / "model_index.json").read_text())["unet"] == ["diffusers", "UNetMotionModel"]
    policy = TextToVideoPolicy.from_pretrained(str(out), num_frames=8, lora_rank=4)
    assert isinstance(policy.unet, UNetMotionModel) and policy.unet.config.motion_max_seq_length == 8
    assert policy.latent_shape == (4, 8, 8, 8) and policy.dtype == torch.float32


def test_arch_motion_without_an_image_model_to_inflate_raises(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_tiny_video.py", "--arch", "motion", "--steps", "1"])
    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match="--arch motion builds the motion UNet from the image model"):
        _script().main()


def test_text_direction_gap_is_zero_without_a_direction_word_and_grows_with_the_word_embeddings(motion):
    """The text-side instrument: 0 exactly when the swap changes nothing ("staying still"), > 0 for a direction word,
    and larger once the direction words' embeddings are drawn apart (the `--reinit-words` start)."""
    _, text_encoder, _, _, tokenizer = motion
    script = _script()

    def ids(texts):
        return tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length,
                         return_tensors="pt").input_ids

    still = ["a red circle staying still"]
    assert script.text_direction_gap(text_encoder, ids(still), ids(still)) == 0
    moving = ["a red circle moving up", "a blue square moving left"]
    swapped = ["a red circle moving down", "a blue square moving right"]
    before = script.text_direction_gap(text_encoder, ids(moving), ids(swapped))
    assert before > 0
    vocab = tokenizer.get_vocab()
    emb = text_encoder.get_input_embeddings().weight
    saved = emb.detach().clone()
    try:
        with torch.no_grad():
            emb[vocab["up"]] += 0.5
            emb[vocab["down"]] -= 0.5
        assert script.text_direction_gap(text_encoder, ids(moving), ids(swapped)) > before
    finally:
        with torch.no_grad():
            emb.copy_(saved)


@pytest.mark.parametrize("t", [0, 300, 600, 900, 999])
def test_v_loss_weighting_turns_the_eps_mse_into_the_v_prediction_mse(t):
    """`--loss-weighting v`: weight_t × ε-MSE equals the MSE of the v-prediction derived from the same ε̂ (v = √ᾱ ε −
    √(1 − ᾱ) x0, x̂0 = (x_t − √(1 − ᾱ) ε̂) / √ᾱ), computed directly, up to the normalising mean over t."""
    from diffusers import DDPMScheduler

    from diffalign.models.tiny_random import SD15_SCHEDULER_CONFIG

    sched = DDPMScheduler(**{k: v for k, v in SD15_SCHEDULER_CONFIG.items()
                             if k not in ("set_alpha_to_one", "timestep_spacing")})
    script = _script()
    raw = 1 / sched.alphas_cumprod.double()  # (1 + SNR) / SNR
    weights = script.loss_weights(sched.alphas_cumprod.double(), "v")
    g = torch.Generator().manual_seed(t)
    x0, eps, eps_hat = (torch.randn(4, 4, 8, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    a = sched.alphas_cumprod[t].double()
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
    x0_hat = (x_t - (1 - a).sqrt() * eps_hat) / a.sqrt()
    v_mse = ((a.sqrt() * eps_hat - (1 - a).sqrt() * x0_hat) - (a.sqrt() * eps - (1 - a).sqrt() * x0)).pow(2).mean()
    eps_mse = (eps_hat - eps).pow(2).mean()
    torch.testing.assert_close(weights[t] * raw.mean() * eps_mse, v_mse, rtol=1e-9, atol=0)
    assert torch.equal(script.loss_weights(sched.alphas_cumprod, "eps"), torch.ones(1000))
    clamped = script.loss_weights(sched.alphas_cumprod.double(), "v", max_weight=50.0)
    assert clamped.max() / clamped.min() == pytest.approx(50.0 / float(raw.min()))
