"""Reference strategies (diffalign/reference/): storage, memory, selection, EMA, named checkpoints, state round trip,
and the reference never aliasing the policy
(docs/guides/field_cases.md#reference-aliasing-the-policy)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.diffusion_dpo import DiffusionDPO
from diffalign.objectives.seppo import SePPO
from diffalign.reference import checkpoint as checkpoint_strategy
from diffalign.reference import ema, frozen_base, pool
from diffalign.reference.checkpoint import CheckpointReference
from diffalign.reference.ema import EmaReference
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.reference.pool import PoolReference
from diffalign.runtime.checkpoint import read_state, write_state
from diffalign.types import PreferenceBatch, WinnerBatch

LN2 = math.log(2.0)


def lora_tensors(policy) -> dict[str, torch.Tensor]:
    """The policy adapter's tensors by peft name (independent of diffalign.reference)."""
    return {n: p for n, p in policy.unet.named_parameters() if ".default." in n}


def predict(policy, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((2, *policy.latent_shape), generator=gen)
    embeds = policy.encode_prompts(["a red circle", "a blue square"], do_classifier_free_guidance=False)
    with torch.no_grad():
        return policy.predict(latents, torch.tensor([10, 700]), embeds)


def test_configs_match_init_and_yaml_options_instantiate():
    modules = {"FrozenBaseReference": frozen_base, "CheckpointReference": checkpoint_strategy, "EmaReference": ema,
               "PoolReference": pool}
    for name, module in modules.items():
        cls, config = getattr(module, name), getattr(module, f"{name}Config")
        fields = [f for f in config.__dataclass_fields__ if f != "_target_"]
        params = inspect.signature(cls.__init__).parameters
        assert fields == [p for p in params if p != "self"], name
        assert config._target_ == f"{module.__name__}.{name}"
        for f in fields:
            if params[f].default is not inspect.Parameter.empty:
                assert getattr(config(), f) == params[f].default, (name, f)
    from conftest import compose_cfg

    options = sorted(p.stem for p in (Path(pool.__file__).parents[1] / "configs" / "reference").glob("*.yaml"))
    assert options == ["checkpoint", "ema", "frozen_base", "pool"]
    assert compose_cfg([]).reference._target_.endswith("FrozenBaseReference")  # the default
    for option in ("frozen_base", "ema", "pool"):
        assert instantiate(compose_cfg([f"reference={option}"]).reference).strategy == option


def test_adapter_leaves_trainable_parameters_and_rng_alone(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    trainable = [id(p) for p in policy.trainable_parameters()]
    rng = torch.get_rng_state()
    pool = PoolReference()
    pool.setup(policy)
    assert [id(p) for p in policy.trainable_parameters()] == trainable
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in pool.adapter.params.values())
    assert set(policy.lora_state_dict()) == set(build_tiny_random_policy(seed=0).lora_state_dict())  # saved: policy only
    with pytest.raises(ValueError, match="setup"):
        PoolReference().setup(policy)


def test_full_finetune_is_rejected_with_the_fix():
    policy = build_tiny_random_policy(seed=0, lora_rank=None)
    for strategy in (FrozenBaseReference(), PoolReference(), EmaReference()):
        with pytest.raises(ValueError, match="model.lora_rank"):
            strategy.setup(policy)


def test_pool_memory_is_k_adapters(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    adapter_bytes = sum(p.numel() * 4 for p in policy.trainable_parameters())  # float32 LoRA matrices
    pool = PoolReference(save_every=1, keep=3)
    pool.setup(policy)
    for step in range(6):
        perturb_lora(policy, seed=10 + step)
        pool.on_step(policy, step)
    assert len(pool.snapshots) == 3 and pool.snapshot_steps == [0, 4, 5]  # θ_0 kept, oldest others evicted
    counted = {}
    for snapshot in pool.snapshots:
        for t in snapshot.values():
            counted[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(counted.values()) == 3 * adapter_bytes == pool.stored_bytes()
    assert pool.adapter.nbytes == adapter_bytes  # plus one reference adapter, whatever K is
    policy_ptrs = {p.untyped_storage().data_ptr() for p in policy.unet.parameters()}
    assert not policy_ptrs & set(counted)

    no_initial = PoolReference(save_every=1, keep=3, keep_initial=False)
    no_initial.setup(policy := build_tiny_random_policy(seed=0))
    for step in range(6):
        no_initial.on_step(policy, step)
    assert no_initial.snapshot_steps == [3, 4, 5]


def pick_second(num_snapshots: int, snapshot_steps: list[int], generator: torch.Generator) -> int:
    return min(1, num_snapshots - 1)


def pick_out_of_range(num_snapshots: int, snapshot_steps: list[int], generator: torch.Generator) -> int:
    return num_snapshots


def test_selection_strategies():
    draws = {}
    for selection in ("uniform", "latest", "initial", "test_reference:pick_second"):
        pool = PoolReference(save_every=2, keep=10, selection=selection, seed=5)
        pool.setup(policy := build_tiny_random_policy(seed=0))
        draws[selection] = []
        for step in range(10):
            if pool.on_step(policy, step):
                draws[selection].append(pool.selected)
            assert pool.drawn_at_step == step - step % 2
    assert draws["latest"] == [0, 1, 2, 3, 4] and draws["initial"] == [0] * 5
    assert draws["test_reference:pick_second"] == [0, 1, 1, 1, 1]
    gen = torch.Generator().manual_seed(5)
    assert draws["uniform"] == [int(torch.randint(0, k, (1,), generator=gen)) for k in range(1, 6)]

    per_step = PoolReference(save_every=3, keep=10, redraw="step")
    per_step.setup(policy := build_tiny_random_policy(seed=0))
    assert [per_step.on_step(policy, s) for s in range(4)] == [True] * 4 and per_step.version == 4
    with pytest.raises(ValueError, match="reference.selection"):
        PoolReference(selection="best")
    with pytest.raises(ValueError, match="reference.selection"):
        PoolReference(selection="no_such_module:f")
    bad = PoolReference(selection="test_reference:pick_out_of_range")
    bad.setup(policy := build_tiny_random_policy(seed=0))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        bad.on_step(policy, 0)
    with pytest.raises(TypeError, match="reference.selection"):
        PoolReference(selection="math:pi")
    for kwargs, field in (({"save_every": 0}, "save_every"), ({"keep": 0}, "keep"), ({"redraw": "x"}, "redraw")):
        with pytest.raises(ValueError, match=f"reference.{field}"):
            PoolReference(**kwargs)


def test_pool_reference_runs_the_snapshot(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy, seed=1)
    pool = PoolReference(save_every=100)
    pool.setup(policy)
    pool.on_step(policy, 0)
    perturb_lora(policy, seed=2)  # the policy moves on

    at_snapshot = build_tiny_random_policy(seed=0)
    perturb_lora(at_snapshot, seed=1)
    moved = build_tiny_random_policy(seed=0)
    perturb_lora(moved, seed=2)
    with pool.use(policy):
        assert not policy.unet.training
        torch.testing.assert_close(predict(policy), predict(at_snapshot), rtol=0, atol=1e-6)
    torch.testing.assert_close(predict(policy), predict(moved), rtol=0, atol=1e-6)
    assert not torch.allclose(predict(at_snapshot), predict(moved), atol=1e-4)


def test_frozen_base_keeps_diffusion_dpo_bit_for_bit(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    gen = torch.Generator().manual_seed(0)
    shape = (2, *policy.latent_shape)
    prompts = ["a red circle", "two blue squares"]
    batch = PreferenceBatch(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), prompts,
                            policy.encode_prompts(prompts, do_classifier_free_guidance=False))
    results = []
    for reference in (None, FrozenBaseReference()):
        policy.unet.zero_grad(set_to_none=True)
        loss, metrics = DiffusionDPO(beta=500.0)(policy, batch, generator=torch.Generator().manual_seed(1),
                                                 reference=reference)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad.clone() for p in policy.trainable_parameters()]))
    (loss_a, m_a, g_a), (loss_b, m_b, g_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(m_a[k], m_b[k]) for k in m_a)
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))


def test_ema_reference(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy, seed=1)
    start = {n: p.detach().clone() for n, p in lora_tensors(policy).items()}
    ema = EmaReference(decay=0.75, update_every=2)
    ema.setup(policy)
    perturb_lora(policy, seed=2)
    now = {n: p.detach().clone() for n, p in lora_tensors(policy).items()}
    assert [ema.on_step(policy, s) for s in (0, 1, 2, 2)] == [False, False, True, False]
    ref = {n.replace(".reference.", ".default."): p for n, p in policy.unet.named_parameters() if ".reference." in n}
    for name, value in start.items():
        torch.testing.assert_close(ref[name], 0.75 * value + 0.25 * now[name])
    with pytest.raises(ValueError, match="reference.decay"):
        EmaReference(decay=1.0)


def test_named_checkpoint_reference(tmp_path, perturb_lora):
    trained = build_tiny_random_policy(seed=0)
    perturb_lora(trained, seed=3)
    trained.save_lora_weights(tmp_path / "ckpt")
    policy = build_tiny_random_policy(seed=0)  # fresh adapter: the policy is the base model
    reference = CheckpointReference(str(tmp_path / "ckpt"))
    reference.setup(policy)
    with reference.use(policy):
        torch.testing.assert_close(predict(policy), predict(trained), rtol=0, atol=1e-6)
    with FrozenBaseReference().use(policy):
        base = predict(policy)
    assert not torch.allclose(base, predict(trained), atol=1e-4)  # the checkpoint, not the adapter-disabled base

    with pytest.raises(ValueError, match="reference.path"):
        CheckpointReference(str(tmp_path / "missing")).setup(build_tiny_random_policy(seed=0))
    from conftest import compose_cfg

    from diffalign.config.validation import validate_train_config

    with pytest.raises(ValueError, match="reference.path is required"):  # before any model is loaded
        validate_train_config(compose_cfg(["reference=checkpoint"]))
    with pytest.raises(FileNotFoundError, match="reference.path"):
        validate_train_config(compose_cfg(["reference=checkpoint", f"reference.path={tmp_path / 'missing'}"]))
    validate_train_config(compose_cfg(["reference=checkpoint", f"reference.path={tmp_path / 'ckpt'}"]))
    with pytest.raises(ValueError, match="lora_rank"):
        CheckpointReference(str(tmp_path / "ckpt")).setup(build_tiny_random_policy(seed=0, lora_rank=2))


def test_pool_state_round_trip(tmp_path, perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    pool = PoolReference(save_every=1, keep=3, seed=9)
    pool.setup(policy)
    for step in range(4):
        perturb_lora(policy, seed=step)
        pool.on_step(policy, step)
    pool.samples.items["a red circle"] = torch.arange(4.0)
    write_state(pool.state_dict(), tmp_path, "reference_state")

    other_policy = build_tiny_random_policy(seed=0)
    restored = PoolReference(save_every=1, keep=3, seed=0)
    restored.setup(other_policy)
    restored.load_state_dict(read_state(tmp_path, "reference_state"))
    assert (restored.selected, restored.drawn_at_step, restored.snapshot_steps, restored.version) == (
        pool.selected, pool.drawn_at_step, pool.snapshot_steps, pool.version)
    for a, b in zip(pool.snapshots, restored.snapshots):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(restored.samples.items["a red circle"], torch.arange(4.0))
    for step in range(4, 8):  # same RNG of the selection: same future draws
        perturb_lora(policy, seed=step)
        perturb_lora(other_policy, seed=step)
        pool.on_step(policy, step)
        restored.on_step(other_policy, step)
        assert restored.selected == pool.selected
    mismatched = PoolReference(save_every=1, keep=4)
    mismatched.setup(build_tiny_random_policy(seed=0))
    with pytest.raises(ValueError, match="reference.keep=3"):
        mismatched.load_state_dict(read_state(tmp_path, "reference_state"))


# -------------------------------------------------------------------------------------- no aliasing, 3 steps


def test_reference_unchanged_and_disjoint_from_the_policy_after_three_steps(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy, seed=1)
    initial = {n: p.detach().clone() for n, p in lora_tensors(policy).items()}
    pool = PoolReference(save_every=100)
    pool.setup(policy)
    policy.unet.train()
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    objective = SePPO(beta=5000.0, sampler={"name": "ddim", "num_inference_steps": 2, "guidance_scale": 2.0, "eta": 0.0})
    gen = torch.Generator().manual_seed(0)
    prompts = ["a red circle", "two blue squares"]
    batch = WinnerBatch(torch.randn((2, *policy.latent_shape), generator=gen), prompts,
                        policy.encode_prompts(prompts, do_classifier_free_guidance=False))
    modes = []
    for step in range(3):
        pool.on_step(policy, step)
        loss, _ = objective(policy, batch, generator=gen, reference=pool)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with pool.use(policy):
            modes.append(policy.unet.training)
    loss, _ = objective(policy, batch, generator=gen, reference=pool)

    reference = {n.replace(".reference.", ".default."): p for n, p in policy.unet.named_parameters()
                 if ".reference." in n}
    assert set(reference) == set(initial)
    policy_ptrs = {p.untyped_storage().data_ptr() for n, p in policy.unet.named_parameters() if ".reference." not in n}
    snapshot_ptrs = {t.untyped_storage().data_ptr() for t in pool.snapshots[0].values()}
    for name, tensor in reference.items():
        assert torch.equal(tensor, initial[name]), name
        assert torch.equal(pool.snapshots[0][name.replace(".default.", ".")], initial[name]), name
        assert tensor.untyped_storage().data_ptr() not in policy_ptrs | snapshot_ptrs, name
        assert not tensor.requires_grad and tensor.grad is None
    assert not snapshot_ptrs & policy_ptrs
    assert modes == [False] * 3 and policy.unet.training  # eval inside use(), the policy's mode restored after
    moved = max((p - initial[n]).abs().max().item() for n, p in lora_tensors(policy).items())
    assert moved > 0
    assert loss.item() != pytest.approx(LN2, abs=1e-6)
