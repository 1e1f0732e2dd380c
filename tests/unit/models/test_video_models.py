"""Video policies (UNet3D `TextToVideoSDPipeline`, Wan `WanPipeline`): layouts, rollouts on 5-D latents, per-position
log-probs, LoRA, export, and the online methods (ViPO, Flow-GRPO, DGPO) on video latents."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from conftest import load_script, step_sampler
from diffusers import FlowMatchEulerDiscreteScheduler

from diffalign.models.tiny_video import build_tiny_t2v_policy, build_tiny_wan_pipeline, build_tiny_wan_policy
from diffalign.models.wan import WanPolicy
from diffalign.objectives.vipo import ViPO
from diffalign.runtime.media import save_video
from diffalign.samplers.rollout import recompute_step, rollout

PROMPTS = ["a red circle moving left", "a blue square staying still", "a green triangle moving up"]


def build(family):
    return (build_tiny_t2v_policy(num_frames=4), 1.0) if family == "t2v" else (build_tiny_wan_policy(), 0.7)


@pytest.mark.parametrize("family", ["t2v", "wan"])
def test_a_video_rollout_keeps_its_batch_axis_and_export_writes_one_file_per_video(family, tmp_path):
    policy, eta = build(family)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta),
                   generator=gens, reduction="per_position")
    c, f_lat, h, w = policy.latent_shape
    frames = policy.num_frames
    assert traj.latents.shape == (3, 4, c, f_lat, h, w)
    assert traj.log_probs.shape == (3, 3, f_lat, h, w)
    assert traj.images.shape == (3, frames, 3, 32, 32) and traj.images.min() >= 0 and traj.images.max() <= 1
    # video i is decoded from latent i alone
    alone = policy.decode(traj.latents[1:2, -1])
    torch.testing.assert_close(alone[0], traj.images[1], rtol=1e-4, atol=1e-4)
    for fmt in ("gif", "mp4"):
        paths = [save_video(v, tmp_path / f"v{i}.{fmt}") for i, v in enumerate(traj.images)]
        assert len(paths) == 3
        for p in paths:
            assert iio.imread(p).shape[0] == frames  # F frames each
    with torch.no_grad():
        step = recompute_step(policy, traj, 2, reduction="per_position")
    torch.testing.assert_close(step.log_prob, traj.log_probs[:, 2], rtol=0, atol=1e-4)


def test_wan_euler_rollout_equals_the_wan_pipeline():
    pipe = build_tiny_wan_pipeline(seed=0)
    policy = WanPolicy(pipe, num_frames=9, lora_rank=4, max_sequence_length=16)
    noise = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
    traj = rollout(policy, PROMPTS[:2], step_sampler(policy, num_inference_steps=4, guidance_scale=3.0, noise=0.0),
                   latents=noise)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=policy.scheduler.config.shift)
    out = pipe(prompt=PROMPTS[:2], height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=3.0,
               latents=noise.clone(), output_type="latent", max_sequence_length=16).frames
    torch.testing.assert_close(traj.latents[:, -1], out.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["t2v", "wan"])
def test_video_lora_saves_loads_and_the_reference_disables_it(family, tmp_path):
    policy, _ = build(family)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = torch.randn((1, *policy.latent_shape), generator=torch.Generator().manual_seed(1))
    embeds = policy.encode_prompts(PROMPTS[:1], do_classifier_free_guidance=False)
    t = torch.tensor([500.0]) if family == "wan" else torch.tensor([500])
    with torch.no_grad():
        adapted = policy.predict(x, t, embeds)
        with policy.reference():
            base = policy.predict(x, t, embeds)
    assert not torch.allclose(adapted, base)
    policy.save_lora_weights(tmp_path)
    fresh, _ = build(family)
    fresh.load_lora_weights(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(fresh.predict(x, t, embeds), adapted, rtol=1e-5, atol=1e-5)
    if family == "wan":  # the file loads into a plain diffusers WanPipeline
        pipe = build_tiny_wan_pipeline(seed=0)
        pipe.load_lora_weights(tmp_path)
        with torch.no_grad():
            out = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds.prompt_embeds,
                                   return_dict=False)[0]
        torch.testing.assert_close(out.float(), adapted, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["t2v", "wan"])
def test_vipo_maps_on_video_latent_grids(family):
    policy, eta = build(family)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    traj = rollout(policy, PROMPTS, step_sampler(policy, num_inference_steps=2, guidance_scale=4.5, noise=eta),
                   generator=gens, reduction="per_position")
    vipo = ViPO()
    adv = torch.tensor([1.0, -2.0, 0.5])
    vipo.prepare_epoch(policy, traj, adv)
    assert vipo.maps.shape == (3, *policy.latent_shape[1:]) and vipo.maps.min() >= 0 and vipo.maps.max() <= 1
    signs = torch.sign(vipo.advantage_maps.flatten(1))
    assert (signs[0] >= 0).all() and (signs[1] <= 0).all() and (signs[2] >= 0).all()
    loss, _ = vipo(policy, traj, adv, 0, rows=torch.arange(3))
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())


CASES = {
    "vipo_t2v": ["model=tiny_t2v_random", "method=vipo", "sampler=ddim", "online.shared_initial_noise=true"],
    "vipo_wan": ["model=tiny_wan_random", "method=vipo", "sampler=flow_sde", "online.shared_initial_noise=true"],
    "flow_grpo_wan": ["model=tiny_wan_random", "method=flow_grpo", "sampler=flow_sde"],
    "dgpo_t2v": ["model=tiny_t2v_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
                 "method.timesteps_per_epoch=2"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_online_methods_run_on_video_models(case, tmp_path):
    from conftest import compose_cfg, online_overrides

    from diffalign.config.validation import validate_train_config
    from diffalign.train.online import train

    cfg = compose_cfg(CASES[case] + online_overrides(tmp_path) + [
        "online.prompts=video_train", "reward=[video_motion]", "online.groups_per_epoch=2"])
    validate_train_config(cfg)
    results = train(cfg)
    assert results["rollouts"] == 16
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert all(np.isfinite(h["loss"]) for h in history) and "reward/video_motion/mean" in history[0]


@pytest.mark.parametrize("family", ["t2v", "wan"])
def test_seppo_accepts_video_latents(family):
    """SePPO on video: the winner is a video latent, the reference sample a video rollout; the loss starts at ln 2."""
    import math

    from diffalign.objectives.seppo import SePPO
    from diffalign.reference.pool import PoolReference
    from diffalign.types import WinnerBatch

    policy, _ = build(family)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    pool = PoolReference(save_every=100, keep=3)
    pool.setup(policy)
    pool.on_step(policy, 0)
    latents = torch.randn((2, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
    batch = WinnerBatch(latents, PROMPTS[:2], policy.encode_prompts(PROMPTS[:2], do_classifier_free_guidance=False),
                        torch.arange(2))
    seppo = SePPO(beta=5000.0, aaf_mode="sign",
                  sampler=step_sampler(policy, num_inference_steps=2, guidance_scale=2.0, noise=0.0))
    loss, _ = seppo(policy, batch, generator=torch.Generator().manual_seed(0), reference=pool)
    assert loss.item() == pytest.approx(math.log(2.0), abs=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in policy.trainable_parameters() if p.grad is not None)


@pytest.mark.parametrize("fmt", ["gif", "mp4"])
def test_evaluation_of_a_video_model_writes_one_file_of_f_frames_per_video(fmt, tmp_path):
    from diffalign.evaluation.evaluate import evaluate_policy
    from diffalign.evaluation.generation import EvalConfig
    from diffalign.rewards.video import VideoMotion
    from diffalign.world.prompts import load_prompts

    policy = build_tiny_t2v_policy(num_frames=4)
    rows = load_prompts("video_heldout")[:3]
    cfg = EvalConfig(prompts="video_heldout", seeds=[0, 1], sampler={"name": "ode", "num_inference_steps": 2},
                     batch_size=4, video_format=fmt)
    metrics = evaluate_policy(policy, rows, {"video_motion": VideoMotion()}, cfg, tmp_path, {"base": True},
                              progress=False)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and len({s["video"] for s in samples}) == 6
    for s in samples:
        assert s["video"].endswith(f".{fmt}") and iio.imread(tmp_path / s["video"]).shape[0] == 4
    assert metrics["variants"]["base"]["video_motion/accuracy"] == 0.0  # a random model moves nothing correctly


@pytest.mark.slow
def test_video_pretraining_script_runs_and_writes_a_loadable_pipeline(tmp_path, monkeypatch):
    """``scripts/pretrain_tiny_video.py`` (its ``main``, run in this process: a child's start is not what is checked)."""
    import sys

    from conftest import REPO

    from diffalign.config.compose import asset_path
    from diffalign.models.text_to_video import TextToVideoPolicy

    script = load_script("pretrain_tiny_video")
    out = tmp_path / "tiny_t2v"
    monkeypatch.setattr(sys, "argv", ["pretrain_tiny_video.py", "--steps", "2", "--batch", "2", "--num-videos", "8",
                                      "--eval-seeds", "0", "--eval-prompts", "2", "--eval-steps", "2", "--out",
                                      str(out)])
    monkeypatch.chdir(REPO)
    script.main()
    metrics = json.loads((out / "pretrain_metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["heldout"]["n"] == 2
    assert (out / "vae").exists()  # a complete pipeline: it loads alone (its own VAE, tiny_sd's) ...
    policy = TextToVideoPolicy.from_pretrained(str(out), num_frames=8, lora_rank=4)
    assert policy.latent_shape == (4, 8, 8, 8) and policy.dtype == torch.float32
    assert len(policy.tokenizer) == 28  # the video tokenizer (motion words)
    # ... or with another folder's VAE as model.vae (tiny_sd3's: the same tiny world VAE, stored in float16)
    TextToVideoPolicy.from_pretrained(str(out), num_frames=8, lora_rank=4, vae=asset_path("tiny_sd3/vae"))


def test_training_logs_hold_one_video_of_f_frames_per_monitor_prompt(tmp_path):
    """Issue 8 item 4 (video export in the logs): with the monitors on, every measurement writes the first seed's
    video of each monitor prompt as one GIF of F frames under logs/samples/step-<N>/, with the prompts listed; the
    diversity of a video model embeds its frames (the frame-mean embedding)."""
    import imageio.v3 as iio
    from conftest import compose_cfg, online_overrides

    from diffalign.train.online import train

    cfg = compose_cfg(CASES["dgpo_t2v"] + online_overrides(tmp_path) + [
        "online.prompts=video_train", "reward=[video_motion]", "online.groups_per_epoch=2", "monitor.every=1",
        "monitor.prompts=video_heldout", "monitor.num_prompts=2", "monitor.seeds=[0,1]",
        "monitor.sampler.num_inference_steps=2", "model.num_frames=4"])
    train(cfg)
    steps = sorted(p.name for p in (tmp_path / "logs" / "samples").iterdir())
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert steps == sorted(f"step-{h['step']}" for h in history)  # one folder per measurement (step 0 included)
    last = tmp_path / "logs" / "samples" / steps[-1]
    gifs = sorted(last.glob("*.gif"))
    assert [g.name for g in gifs] == ["000.gif", "001.gif"]
    assert all(iio.imread(g, index=None).shape[0] == 4 for g in gifs)  # F = 4 frames each
    assert len((last / "prompts.txt").read_text().splitlines()) == 2
    assert all(0 <= h["monitor/diversity"] <= 2 for h in history)


def test_disable_dropout_makes_a_training_forward_deterministic():
    from diffalign.models.base import disable_dropout

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.Dropout(0.1), torch.nn.Dropout2d(0.2),
                              torch.nn.Dropout(0.0)).train()
    x = torch.randn(2, 3, 4, 4)
    assert not torch.equal(net(x), net(x))  # dropout is on: two forwards differ
    assert disable_dropout(net) == 2  # the two layers with p > 0
    assert torch.equal(net(x), net(x))
    assert disable_dropout(net) == 0


def saved_unet3d_folder(folder):
    """A tiny random UNet3D `TextToVideoSDPipeline` saved as a folder (`save_pretrained`, the format
    `scripts/pretrain_tiny_video.py` writes). Its temporal convolutions' last layers are drawn at random: diffusers
    starts them at zero, which would hide the dropout in front of them (a trained model's are not zero)."""
    from diffusers.models.resnet import TemporalConvLayer

    from diffalign.models.tiny_video import build_tiny_t2v_pipeline

    pipe = build_tiny_t2v_pipeline(seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in pipe.unet.modules():
            if isinstance(layer, TemporalConvLayer):
                layer.conv4[-1].weight.copy_(0.1 * torch.randn(layer.conv4[-1].weight.shape, generator=gen))
    pipe.save_pretrained(folder)
    return folder


def test_a_saved_unet3d_policy_recomputes_the_rollouts_log_probs_in_training_mode(tmp_path):
    """diffusers' UNet3D has dropout 0.1 in its temporal convolutions; in training mode it made the recomputed
    log-probs of the tiny UNet3D base (model=tiny_t2v, since retired) differ from the rollout's by up to 4.5 nats per
    position before any update. A policy loaded from a folder switches the dropout off, so the ratio π_θ / π_old is 1
    there (the check of `method.logprob_check`)."""
    from diffusers import UNet3DConditionModel

    from diffalign.models.text_to_video import TextToVideoPolicy

    folder = saved_unet3d_folder(tmp_path / "t2v")
    raw = UNet3DConditionModel.from_pretrained(folder, subfolder="unet")
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in raw.modules())  # what the policy must undo
    policy = TextToVideoPolicy.from_pretrained(str(folder), num_frames=4, lora_rank=4)
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.denoiser.modules())
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    policy.denoiser.eval()
    traj = rollout(policy, PROMPTS[:2], step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=1.0),
                   generator=gens, reduction="per_position")
    policy.denoiser.train()  # as the online loop recomputes
    for k in range(3):
        step = recompute_step(policy, traj, k, reduction="per_position")
        torch.testing.assert_close(step.log_prob.detach(), traj.log_probs[:, k], rtol=0, atol=1e-3)


def test_a_unet3d_folder_without_a_vae_loads_with_model_vae(tmp_path):
    """`model.vae` (`TextToVideoPolicy.from_pretrained(..., vae=<folder>)`): a pipeline folder stored without a VAE of
    its own loads with one from elsewhere (the retired model=tiny_t2v did so with tiny_sd3's); a path that is not a VAE
    folder is refused before anything loads, naming the field."""
    import shutil

    from diffalign.models.text_to_video import TextToVideoPolicy

    folder = saved_unet3d_folder(tmp_path / "t2v")
    shutil.move(folder / "vae", tmp_path / "vae")
    policy = TextToVideoPolicy.from_pretrained(str(folder), num_frames=4, lora_rank=None, vae=tmp_path / "vae")
    expected = build_tiny_t2v_policy(num_frames=4, lora_rank=None).vae.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in policy.vae.state_dict().items())
    with pytest.raises(ValueError, match=r"model.vae='/no/such/vae' is not a VAE folder"):
        TextToVideoPolicy.from_pretrained(str(folder), vae="/no/such/vae")
