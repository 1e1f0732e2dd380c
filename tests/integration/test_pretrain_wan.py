"""The Wan-format tiny video base (`scripts/pretrain_tiny_video.py --arch wan`, issue 34 item 4): both stages run a
few steps, resume bit for bit, and the export loads through ``model=tiny_wan_t2v`` and samples."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script, same_state

from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--arch", "wan", "--threads", "1", "--wan-vae-dim", "8", "--wan-vae-batch", "2", "--wan-width", "32",
         "--wan-layers", "1", "--wan-heads", "2", "--wan-text-width", "32", "--num-videos", "8", "--batch", "2",
         "--eval-prompts", "2", "--eval-seeds", "0", "--eval-steps", "2"]


def _script():
    return load_script("pretrain_tiny_video")


def _main(args: list[str], monkeypatch, capsys) -> str:
    """The script's ``main`` with `args` in this process: what it printed."""
    script = _script()
    monkeypatch.setattr(sys, "argv", ["pretrain_tiny_video.py", *args])
    capsys.readouterr()
    script.main()
    return capsys.readouterr().out


def _run(args: list[str]) -> str:
    """The script in a new process (a resumed run starts from nothing but its checkpoint)."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_tiny_video.py"), *args], check=False,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def _check_resumed(a_path: Path, b_path: Path, at_2: dict, steps: int) -> None:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    assert a["step"] == b["step"] == steps and at_2["step"] == 2
    for key in set(a) - {"elapsed"}:
        assert same_state(a[key], b[key]), key
    for before, after in zip(at_2["modules"], b["modules"]):  # the resumed half did train
        moved = [n for n, v in after.items() if v.is_floating_point() and not torch.equal(before[n], v)]
        assert len(moved) > 0.9 * sum(v.is_floating_point() for v in after.values())


def test_shift_sigmas_is_the_flow_match_schedulers_shift():
    """σ' = sσ / (1 + (s − 1)σ): 0.5 → 0.75 at s = 3 by hand, and diffusers' FlowMatchEulerDiscreteScheduler(shift=3)
    spaces its sigmas the same way."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    shift = _script().shift_sigmas
    assert shift(torch.tensor([0.5]), 3.0).item() == pytest.approx(0.75)
    plain = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).sigmas[:-1]
    shifted = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0).sigmas[:-1]
    torch.testing.assert_close(shift(plain, 3.0), shifted, rtol=1e-5, atol=1e-6)


def test_direction_probe_of_a_model_that_predicts_zero():
    """A transformer that returns zeros: the MSE is E[(ε − x0)²] over the probe's fixed noise (drawn here by hand from
    the same generator), and neither the caption nor reversing the frames changes it (both gaps 0)."""
    lat = torch.randn(3, 4, 9, 8, 8, generator=torch.Generator().manual_seed(5))

    def zero(hidden_states, timestep, encoder_hidden_states, return_dict):
        return (torch.zeros_like(hidden_states),)

    res = _script().wan_direction_probe(zero, lambda texts: torch.randn(len(texts), 16, 8), lat, ["a"] * 3,
                                        ["b"] * 3, sigmas=(0.3, 0.9))
    g = torch.Generator().manual_seed(123)
    for t in (300, 900):
        noise = torch.randn(lat.shape, generator=g)
        assert res[t]["true"] == pytest.approx((noise - lat).pow(2).mean().item(), rel=1e-6)
        assert res[t]["swapped_caption_gap"] == 0 and abs(res[t]["reversed_frames_gap"]) < 1e-6  # (summation order)


@pytest.mark.slow
def test_wan_vae_stage_resumes_bit_for_bit(tmp_path, monkeypatch, capsys):
    """Four VAE steps in one go against two, a checkpoint, a new process with --resume, two more: the step-4
    checkpoints hold identical weights, optimizer, LR schedule and RNG states."""
    base = SMALL + ["--wan-stage", "vae", "--wan-vae-steps", "4"]
    _main(base + ["--work", str(tmp_path / "a"), "--stop-at", "4"], monkeypatch, capsys)
    assert "stopped at step 2" in _main(base + ["--work", str(tmp_path / "b"), "--stop-at", "2"], monkeypatch, capsys)
    at_2 = torch.load(tmp_path / "b" / "wan_vae_checkpoint.pt", weights_only=False)
    assert "resumed from" in _run(base + ["--work", str(tmp_path / "b"), "--stop-at", "4", "--resume"])
    _check_resumed(tmp_path / "a" / "wan_vae_checkpoint.pt", tmp_path / "b" / "wan_vae_checkpoint.pt", at_2, 4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished few-step run of both stages (VAE 3 steps, transformer 3 steps, instruments at step 2)."""
    work = tmp_path_factory.mktemp("wan")
    out = _run(SMALL + ["--work", str(work), "--wan-vae-steps", "3", "--steps", "3", "--probe-every", "2",
                        "--eval-every", "2"])
    return work, out


def test_a_finished_vae_stage_is_not_trained_again_on_resume(trained, monkeypatch, capsys):
    """``--wan-stage all --resume`` on a work folder whose VAE stage finished: the VAE is neither rebuilt nor re-saved
    (the full run re-trained its last 25 steps from the checkpoint and re-saved it, which changed the file's time and so
    re-encoded the 16,000-video latents cache), and the transformer stage goes on from its own state."""
    work, _ = trained
    weights = work / "wan_vae" / "diffusion_pytorch_model.safetensors"
    stamp = weights.stat().st_mtime_ns
    script = _script()
    monkeypatch.setattr(script, "build_wan_vae", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rebuilt")))
    args = script.argparse.Namespace(resume=True, wan_vae_steps=3)
    assert script.train_wan_vae(args, work, None) == work / "wan_vae"
    assert "finished earlier" in capsys.readouterr().out and weights.stat().st_mtime_ns == stamp
    with pytest.raises(AssertionError, match="rebuilt"):  # another length: not the finished stage, not skipped
        script.train_wan_vae(script.argparse.Namespace(resume=True, wan_vae_steps=4, device="cpu", seed=0,
                                                       wan_vae_dim=8, wan_z_dim=4), work, None)


@pytest.mark.slow
def test_wan_transformer_stage_resumes_bit_for_bit(trained, tmp_path, monkeypatch, capsys):
    """On the trained VAE: five transformer steps in one go against two, a checkpoint, a new process with --resume,
    three more (the probe at step 2 and 4 and a held-out evaluation at step 4 in between): identical step-5
    checkpoints, instruments included."""
    work, _ = trained
    for name in ("a", "b"):
        shutil.copytree(work / "wan_vae", tmp_path / name / "wan_vae")
    base = SMALL + ["--wan-stage", "transformer", "--steps", "5", "--probe-every", "2", "--eval-every", "4"]
    _main(base + ["--work", str(tmp_path / "a"), "--stop-at", "5"], monkeypatch, capsys)
    assert "stopped at step 2" in _main(base + ["--work", str(tmp_path / "b"), "--stop-at", "2"], monkeypatch, capsys)
    at_2 = torch.load(tmp_path / "b" / "wan_checkpoint.pt", weights_only=False)
    assert "resumed from" in _run(base + ["--work", str(tmp_path / "b"), "--stop-at", "5", "--resume"])
    _check_resumed(tmp_path / "a" / "wan_checkpoint.pt", tmp_path / "b" / "wan_checkpoint.pt", at_2, 5)
    evals = torch.load(tmp_path / "b" / "wan_checkpoint.pt", weights_only=False)["evals"]
    assert [e["step"] for e in evals if "probe" in e] == [2, 4]
    assert [e["step"] for e in evals if "heldout" in e] == [4]
    assert not (tmp_path / "b" / "tiny_wan_t2v").exists()  # a stopped run saves no pipeline


def test_the_export_loads_as_model_tiny_wan_t2v_and_samples(trained):
    """The saved WanPipeline through the shipped config (its path overridden): 9 frames of 32×32 from (4, 9, 8, 8)
    latents; the VAE's measured latents_mean / latents_std normalise fresh train videos to about zero mean and unit
    std per channel; the metrics hold both stages' records."""
    from diffalign.lora.initial import build_policy
    from diffalign.samplers.ode import PipelineODESampler
    from diffalign.samplers.rollout import rollout
    from diffalign.world.prompts import load_prompts
    from diffalign.world.video import render_video, videos_to_tensor

    work, printed = trained
    assert "wan vae latents_mean" in printed and "EMA accuracy" in printed and "t900: swap" in printed
    cfg = compose_cfg(["model=tiny_wan_t2v", f"model.pretrained_model_name_or_path={work / 'tiny_wan_t2v'}"])
    policy = build_policy(cfg)
    assert type(policy.transformer).__name__ == "WanTransformer3DModel" and policy.latent_shape == (4, 9, 8, 8)
    rows = load_prompts("video_train")[:2]
    traj = rollout(policy, [r["prompt"] for r in rows], PipelineODESampler(num_inference_steps=2, guidance_scale=4.0),
                   generator=[torch.Generator().manual_seed(k) for k in range(2)])
    assert traj.images.shape == (2, 9, 3, 32, 32) and 0 <= traj.images.min() and traj.images.max() <= 1
    rows = load_prompts("video_train")
    pick = np.random.default_rng(7).integers(len(rows), size=64)
    videos = videos_to_tensor(np.stack([render_video(rows[i], seed=int(70_000 + k), num_frames=9)
                                        for k, i in enumerate(pick)]))
    with torch.no_grad():
        lat = policy.encode_images(videos)
    assert lat.mean(dim=(0, 2, 3, 4)).abs().max() < 0.25
    assert ((lat.std(dim=(0, 2, 3, 4)) - 1).abs() < 0.25).all()
    metrics = json.loads((work / "tiny_wan_t2v" / "pretrain_metrics.json").read_text())
    assert metrics["arch"] == "wan" and metrics["vae"]["steps"] == 3 and metrics["steps"] == 3
    assert set(metrics["vae"]["heldout_reconstructions"]) == {"accuracy", "direction_sign", "psnr_db", "n"}


def test_wan_init_continues_from_a_saved_folder(trained, tmp_path, monkeypatch, capsys):
    """``--wan-init`` starts the transformer stage from a saved WanPipeline: at ``--lr 0`` (AdamW then moves nothing,
    weight decay included) two more steps save exactly the folder's transformer and text encoder (so the weights load
    strictly and the EMAs start at them) with its VAE; the metrics name the first stage. Other sizes stop before any
    work, naming the flags."""
    from safetensors.torch import load_file

    work, _ = trained
    first = work / "tiny_wan_t2v"
    out = tmp_path / "continued"
    args = SMALL + ["--wan-stage", "transformer", "--steps", "2", "--lr", "0", "--work", str(tmp_path / "w"),
                    "--wan-init", str(first), "--out", str(out)]
    _main(args, monkeypatch, capsys)
    for sub, name in (("transformer", "diffusion_pytorch_model.safetensors"), ("text_encoder", "model.safetensors"),
                      ("vae", "diffusion_pytorch_model.safetensors")):
        a, b = load_file(first / sub / name), load_file(out / sub / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
    metrics = json.loads((out / "pretrain_metrics.json").read_text())
    assert metrics["init"]["folder"] == str(first) and metrics["init"]["steps"] == 3 and metrics["vae"]["steps"] == 3
    wide = [a if a != "32" or args[i - 1] != "--wan-width" else "64" for i, a in enumerate(args)]
    with pytest.raises(SystemExit, match="--wan-init .* does not load into a model of --wan-width 64"):
        _main(wide, monkeypatch, capsys)
    with pytest.raises(SystemExit, match="pass --wan-stage transformer"):
        _main([a if a != "transformer" else "all" for a in args], monkeypatch, capsys)
