"""Atomic checkpoints: bitwise resume of AdamW + LR schedule + RNG, atomicity, and picking the latest checkpoint
(docs/guides/field_cases.md#picking-the-latest-checkpoint)."""

import json
import random

import numpy as np
import pytest
import torch
from diffusers.optimization import get_scheduler
from safetensors.torch import load_file, save_file

from diffalign.runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=2, num_training_steps=10)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    scheduler.step()


def weights_writer(model):
    """Stands in for `policy.save_lora_weights`: writes the trainable weights as safetensors."""
    return lambda directory: save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "pytorch_lora_weights.safetensors")
    )


def save(output_dir, step, model, optimizer, scheduler, **kwargs):
    state = kwargs.pop("state", {"global_step": step})
    return save_checkpoint(
        output_dir,
        step,
        lora_dir_writer=weights_writer(model),
        optimizer=optimizer,
        lr_scheduler=scheduler,
        state=state,
        **kwargs,
    )


def test_adamw_and_scheduler_resume_is_bitwise(tmp_path):
    model, optimizer, scheduler = build()
    for step in range(3):
        train_step(model, optimizer, scheduler, step)
    path = save(tmp_path, 3, model, optimizer, scheduler, state={"global_step": 3, "epoch": 0})
    for step in range(3, 5):
        train_step(model, optimizer, scheduler, step)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    resumed, resumed_optimizer, resumed_scheduler = build(seed=1)  # different init: everything must come from disk
    resumed.load_state_dict(load_file(str(path / "pytorch_lora_weights.safetensors")))
    state = load_checkpoint(path, optimizer=resumed_optimizer, lr_scheduler=resumed_scheduler)
    assert state == {"global_step": 3, "epoch": 0}
    assert resumed_scheduler.last_epoch == 3
    for step in range(3, 5):
        train_step(resumed, resumed_optimizer, resumed_scheduler, step)
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert resumed_optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_files_are_safetensors_and_json_only(tmp_path):
    model, optimizer, scheduler = build()
    train_step(model, optimizer, scheduler, 0)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.json",
        "optimizer.safetensors",
        "pytorch_lora_weights.safetensors",
        "rng_state.json",
        "rng_state.safetensors",
        "scheduler.json",
        "trainer_state.json",
    ]
    tensors = load_file(str(path / "optimizer.safetensors"))
    assert torch.equal(tensors["optimizer.state.0.exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    param_groups = json.loads((path / "optimizer.json").read_text())["param_groups"]
    assert param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] and param_groups[0]["params"] == [0, 1]


def test_rng_states_are_restored(tmp_path):
    model, optimizer, scheduler = build()
    torch.manual_seed(123)
    np.random.seed(4)
    random.seed(5)
    path = save(tmp_path, 0, model, optimizer, scheduler)
    expected = (torch.rand(5), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    load_checkpoint(path, optimizer=optimizer, lr_scheduler=scheduler)
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failed_write_leaves_no_checkpoint(tmp_path, error):
    model, optimizer, scheduler = build()
    first = save(tmp_path, 10, model, optimizer, scheduler)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def failing_writer(directory):
        (directory / "pytorch_lora_weights.safetensors").write_bytes(b"partial")
        raise error

    with pytest.raises(type(error)):
        save_checkpoint(
            tmp_path, 20, lora_dir_writer=failing_writer, optimizer=optimizer, lr_scheduler=scheduler, state={}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert latest_checkpoint(tmp_path) == first


def test_unserialisable_state_raises_and_leaves_nothing(tmp_path):
    model, optimizer, scheduler = build()
    with pytest.raises(TypeError, match="JSON"):
        save(tmp_path, 5, model, optimizer, scheduler, state={"tensor": torch.zeros(1)})
    assert list(tmp_path.iterdir()) == []


def test_argument_checks(tmp_path):
    model, optimizer, scheduler = build()
    save(tmp_path, 5, model, optimizer, scheduler)
    with pytest.raises(FileExistsError, match="checkpoint-5"):
        save(tmp_path, 5, model, optimizer, scheduler)
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 6, model, optimizer, scheduler, keep_last=0)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "checkpoint-404", optimizer=optimizer, lr_scheduler=None)
    no_scheduler = save(tmp_path, 7, model, optimizer, None)
    with pytest.raises(FileNotFoundError, match="scheduler.json"):
        load_checkpoint(no_scheduler, optimizer=optimizer, lr_scheduler=scheduler)


def test_nested_state_roundtrip(tmp_path):
    """Tensors inside param groups, int keys and tuples survive the JSON/safetensors split."""

    class Stateful:
        def __init__(self, state=None):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    model, optimizer, _ = build()
    original = {"lr": torch.tensor([0.5, 0.25]), 3: ("a", 1.5, None), "nested": [{"__tensor__": 1}, float("inf")]}
    path = save(tmp_path, 1, model, optimizer, Stateful(original))
    restored = Stateful()
    load_checkpoint(path, optimizer=optimizer, lr_scheduler=restored)
    assert torch.equal(restored.state["lr"], original["lr"])
    assert restored.state[3] == ("a", 1.5, None)
    assert restored.state["nested"] == [{"__tensor__": 1}, float("inf")]


# ------------------------------------------------------------------------------------------ the latest checkpoint


def test_latest_checkpoint_sorts_numerically_and_ignores_non_numeric(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for name in ["checkpoint-95", "checkpoint-900", "checkpoint-1000", "checkpoint-tmp", ".tmp-checkpoint-2000-1"]:
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-5000").write_text("a file, not a checkpoint directory")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1000"


@pytest.mark.parametrize(("keep_last", "expected"), [(2, [1000, 1100]), (-1, [95, 900, 1000, 1100])])
def test_keep_last_keeps_the_newest_and_minus_one_keeps_all(tmp_path, keep_last, expected):
    for name in ["checkpoint-95", "checkpoint-900", "checkpoint-1000", "checkpoint-tmp"]:
        (tmp_path / name).mkdir()
    model, optimizer, scheduler = build()
    path = save(tmp_path, 1100, model, optimizer, scheduler, keep_last=keep_last)
    numeric = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("checkpoint-*") if p.name[11:].isdigit())
    assert numeric == expected
    assert (tmp_path / "checkpoint-tmp").is_dir() and latest_checkpoint(tmp_path) == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_keep_last_never_deletes_the_checkpoint_just_saved(tmp_path):
    (tmp_path / "checkpoint-5000").mkdir()  # newer step left by an earlier run
    model, optimizer, scheduler = build()
    path = save(tmp_path, 100, model, optimizer, scheduler, keep_last=1)
    assert path.is_dir() and (tmp_path / "checkpoint-5000").is_dir()


def test_resume_epoch_comes_from_checkpoint_metadata(tmp_path):
    """Save every 3 epochs (after epochs 3 and 6, 4 steps per epoch); resuming the latest starts at epoch 7."""
    model, optimizer, scheduler = build()
    step = 0
    for epoch in range(1, 7):
        for _ in range(4):
            train_step(model, optimizer, scheduler, step)
            step += 1
        if epoch % 3 == 0:
            save(tmp_path, step, model, optimizer, scheduler, state={"global_step": step, "epoch": epoch})
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "checkpoint-24"  # the folder name is the step, not the epoch or the save count
    state = load_checkpoint(latest, optimizer=optimizer, lr_scheduler=scheduler)
    assert state["epoch"] + 1 == 7 and state["global_step"] == 24
