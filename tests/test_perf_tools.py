"""The performance tools of scripts/: the online-loop phase benchmark (``bench_online.py``), the minimal peer loop
(``peer_loop.py``), the GPU check (``gpu_check.py``) and the cost-model sweep (``cost_model.py``). What each asserts is
derived apart from the tool: the peer's step log-probs against diffalign's tested samplers and the Gaussian density by
hand; the phase benchmark's call counts against the recipe's arithmetic (steps × rollout batches, units × updates);
the GPU check's throughput against its own step time; no timing is asserted."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from conftest import REPO

SCRIPTS = REPO / "scripts"


def _script(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------- peer loop


def test_the_peer_loop_imports_no_diffalign_above_its_comparison_harness():
    text = (SCRIPTS / "peer_loop.py").read_text()
    loop = text.split("# ---- the comparison")[0] if "# ---- the comparison" in text else \
        text.split("# -------------------------------------------------------------------------------------------"
                   "---- the comparison")[0]
    assert "the comparison" in text and len(loop) < len(text)
    assert "diffalign" not in "".join(line for line in loop.splitlines() if line.lstrip().startswith(("import",
                                                                                                      "from")))


def test_the_peer_ddim_step_matches_diffalign_and_the_gaussian_by_hand():
    from diffusers import DDIMScheduler

    from diffalign.samplers.ddim_logprob import ddim_step

    peer = _script("peer_loop")
    sched = DDIMScheduler.from_pretrained(REPO / "diffalign" / "assets" / "tiny_sd", subfolder="scheduler")
    sched.set_timesteps(10)
    g = torch.Generator().manual_seed(0)
    x, eps, nxt = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    t = sched.timesteps[4].expand(3)
    _, lp, mean, std = peer.ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=nxt)
    ref = ddim_step(sched, eps, t, x, eta=1.0, prev_sample=nxt)
    torch.testing.assert_close(lp, ref.log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, ref.mean, rtol=1e-5, atol=1e-6)
    # scoring the mean itself: only the normaliser, -log s - log sqrt(2 pi) per element
    _, at_mean, _, _ = peer.ddim_step_with_logprob(sched, eps, t, x, 1.0, prev_sample=mean)
    s = float(std.flatten()[0])
    torch.testing.assert_close(at_mean, torch.full((3,), -math.log(s) - 0.5 * math.log(2 * math.pi)))


def test_the_peer_sde_step_matches_diffalign_flow_sde():
    from diffalign.samplers.flow_sde import flow_sde_step

    peer = _script("peer_loop")
    g = torch.Generator().manual_seed(1)
    x, v, nxt = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    sigma, sigma_next = torch.tensor([0.8, 0.8]), torch.tensor([0.6, 0.6])
    _, lp, mean, _ = peer.sde_step_with_logprob(sigma, sigma_next, 0.95, v, x, 0.7, prev_sample=nxt)
    ref = flow_sde_step(v, sigma, sigma_next, x, noise_level=0.7, sigma_max=0.95, prev_sample=nxt)
    torch.testing.assert_close(lp, ref.log_prob, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, ref.mean)


def test_the_peer_tracker_normalises_per_prompt_by_hand():
    peer = _script("peer_loop")
    tracker = peer.PerPromptStatTracker(None, 0, 1e-4)
    out = tracker.update(["a", "a", "b", "b"], torch.tensor([1.0, 3.0, 0.0, 4.0]))
    # a: mean 2, population std 1; b: mean 2, std 2
    torch.testing.assert_close(out, torch.tensor([-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001]))


@pytest.mark.parametrize("method", ["flow_grpo", "ddpo"])
def test_a_peer_epoch_is_on_policy_at_its_first_unit_and_moves_the_lora(method, monkeypatch):
    """Before the update, the log-prob recomputed with gradients equals the stored one (ratio 1: sampling and
    training take the same path), and the epoch's one optimizer step changes the LoRA."""
    peer = _script("peer_loop")
    cfg = peer.quick(peer.PEERS[method])
    loop = peer.PeerLoop(cfg, ["a red circle", "a blue square"], peer.brightness)
    seen = []
    recompute = loop.log_prob

    def spy(sample, rows, k, cond, sched):
        lp, mean, std = recompute(sample, rows, k, cond, sched)
        if torch.is_grad_enabled():
            seen.append((lp.detach() - sample["log_probs"][rows, k]).abs().max())
        return lp, mean, std

    monkeypatch.setattr(loop, "log_prob", spy)
    before = [p.detach().clone() for p in loop.params]
    logs = loop.run_epoch()
    assert logs["units"] == (cfg.groups_per_epoch * cfg.group_size // cfg.batch_size) * max(
        1, int(cfg.num_inference_steps * cfg.timestep_fraction))
    assert float(seen[0]) < 1e-4
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, loop.params))
    assert 0.0 <= logs["reward"] <= 1.0


# ----------------------------------------------------------------------------------------------- bench_online


def test_bench_online_counts_the_denoiser_calls_of_each_phase_and_leaves_the_run_unchanged():
    """Flow-GRPO, 2 prompts x 4 samples, 4 SDE steps, rollout batch 8 (one batch), training batch 8: the rollout calls
    the denoiser 4 times on 2 x 8 guided rows; the update has 1 minibatch x int(4 x 0.99) = 3 transitions, each a
    guided forward+backward and a reference forward (beta_KL > 0)."""
    bench = _script("bench_online")
    overrides = bench.recipe_overrides("tiny_flow_grpo", True, [])
    result = bench.measure("tiny_flow_grpo", overrides, warmup=0, epochs=2, floor_repeats=1)
    epoch = result["epochs"][1]
    calls = epoch["calls"]
    assert sum(calls["rollout"].values()) == 4
    assert all(s.startswith("fwd [(16, 4, 8, 8)") for s in calls["rollout"])
    grad = {s: n for s, n in calls["update"].items() if s.startswith("fwd+bwd")}
    nograd = {s: n for s, n in calls["update"].items() if s.startswith("fwd ")}
    assert sum(grad.values()) == 3 and sum(nograd.values()) == 3
    for phase in ("rollout", "update"):
        assert epoch["floors"][phase] == pytest.approx(sum(n * epoch["per_call"][s] for s, n in calls[phase].items()))
        assert epoch["seconds"][phase] > 0
    assert set(epoch["seconds"]) >= {"rollout", "reward", "advantages", "update"}

    # the same two epochs without the benchmark (no timers, hook or floor replays): the same LoRA, bit for bit
    import tempfile

    from diffalign.console import WarningCounts
    from diffalign.deprecation import migrate_config
    from diffalign.train import online as loop

    assert loop._updates.__module__ == "diffalign.train.online"  # the timers were taken off again
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench.compose_config([*overrides, f"output_dir={tmp}"])
        migrate_config(cfg)
        run = loop._setup(cfg)
        run.warnings = WarningCounts()
        for _ in range(2):
            loop._epoch(run)
            run.epoch += 1
        assert bench.lora_digest(run.policy) == result["lora_sha256"]
