"""`diffalign.runtime.checkpoint` beyond the round trips of test_checkpoint.py, found by mutation testing
(docs/contributing.md#mutation-testing); the integration tests that exercise these (resume refusals, disk full, the run
lock) run whole trainings, too slow to map: the JSON/safetensors split of nested states (colliding keys, marker keys,
non-JSON keys and values), the resume-target refusal, lineages, the clean-up of temporaries, the argument checks and
lineage-aware pruning of `save_checkpoint`, a full disk, `verify_checkpoint`'s messages and CUDA RNG states read on a
machine without CUDA — each with its exact message."""

from __future__ import annotations

import errno
import json
import logging
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffalign.runtime.checkpoint import (
    check_resume_target,
    checkpoint_lineage,
    load_checkpoint,
    new_lineage,
    read_state,
    remove_temporaries,
    save_checkpoint,
    verify_checkpoint,
    write_state,
)
from diffalign.runtime.storage import DiskFullError


def optimizer_of(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return model, optimizer


def save(output_dir, step, optimizer, **kwargs):
    kwargs.setdefault("state", {"global_step": step})
    return save_checkpoint(output_dir, step, lora_dir_writer=lambda d: None, optimizer=optimizer, lr_scheduler=None,
                           **kwargs)


def exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


# ------------------------------------------------------------------------------------------------ nested states


def test_state_round_trip_with_colliding_and_marker_keys(tmp_path):
    """``{"a": {"b": x}}`` and ``{"a.b": y}`` flatten to the same path "s.a.b": the second gets "s.a.b#1" (the count
    of tensors stored before it); a dict with a marker key, an int, float, bool or None key is kept as items."""
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    state = {"a": {"b": x}, "a.b": y, "m": {"__tensor__": 7, "other": 1}, "k": {3: "three", 1.5: [x], True: None,
                                                                             None: (1, "t")}}
    write_state(state, tmp_path, "s")
    assert sorted(load_file(str(tmp_path / "s.safetensors"))) == ["s.a.b", "s.a.b#1", "s.k.1.5.0"]
    flat = json.loads((tmp_path / "s.json").read_text())
    assert flat["a"] == {"b": {"__tensor__": "s.a.b"}} and flat["a.b"] == {"__tensor__": "s.a.b#1"}
    assert flat["m"] == {"__items__": [["__tensor__", 7], ["other", 1]]}
    assert flat["k"]["__items__"][3] == [None, {"__tuple__": [1, "t"]}]
    back = read_state(tmp_path, "s")
    assert torch.equal(back["a"]["b"], x) and torch.equal(back["a.b"], y)
    assert back["m"] == {"__tensor__": 7, "other": 1}
    assert back["k"][3] == "three" and torch.equal(back["k"][1.5][0], x) and back["k"][True] is None
    assert back["k"][None] == (1, "t")


def test_an_empty_state_still_writes_its_tensor_file(tmp_path):
    write_state({"n": 1, "l": [None, "s", 2.5, False]}, tmp_path, "empty")
    assert load_file(str(tmp_path / "empty.safetensors")) == {}
    assert read_state(tmp_path, "empty") == {"n": 1, "l": [None, "s", 2.5, False]}
    # the tensors written are detached CPU copies
    weight = torch.ones(2, requires_grad=True)
    write_state({"w": weight * 2}, tmp_path, "grad")
    assert not read_state(tmp_path, "grad")["w"].requires_grad


def test_non_json_keys_and_values_are_refused(tmp_path):
    with pytest.raises(TypeError, match=exact("cannot checkpoint s.d: dict key (1, 2) of type tuple is not JSON.")):
        write_state({"d": {(1, 2): 0}}, tmp_path, "s")
    with pytest.raises(TypeError, match=exact(
            "cannot checkpoint s.x.0: value of type object is neither a tensor nor JSON.")):
        write_state({"x": [object()]}, tmp_path, "s")
    with pytest.raises(FileNotFoundError, match=exact(
            f"{tmp_path} has no missing.json; was it written by a run with this state?")):
        read_state(tmp_path, "missing")


# ---------------------------------------------------------------------------------------------- resume targets


def checkpoint_at(folder, step, **state):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, **state}))
    return folder


def test_resume_target_refuses_an_output_dir_with_later_checkpoints(tmp_path):
    resume = checkpoint_at(tmp_path / "elsewhere" / "checkpoint-4", 4)
    out = tmp_path / "out"
    check_resume_target(out, resume)  # (no output_dir yet)
    for step in (2, 4):
        (out / f"checkpoint-{step}").mkdir(parents=True)
    check_resume_target(out, resume)  # the same step is not later
    for step in (5, 6, 7):
        (out / f"checkpoint-{step}").mkdir()
    with pytest.raises(ValueError, match=exact(
            f"resume={str(resume)!r} continues from step 4, but output_dir={str(out)!r} already holds later "
            "checkpoints (checkpoint-5, checkpoint-6, checkpoint-7), which this run would run into (checkpoint folders "
            "are never overwritten). To branch from step 4, pass a new output_dir=<folder> with the same resume=...; to "
            f"continue the newest, pass resume=latest; or move the later checkpoints out of {out}")):
        check_resume_target(out, resume)
    (out / "checkpoint-8").mkdir()
    with pytest.raises(ValueError, match=r"\(checkpoint-5, checkpoint-6, checkpoint-7, \.\.\.\)"):
        check_resume_target(str(out), str(resume))


def test_resume_target_must_be_a_readable_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=exact(
            f"resume={str(tmp_path)!r} is not a checkpoint folder (no trainer_state.json); use resume=latest or a path "
            "to a checkpoint-<step> folder")):
        check_resume_target(tmp_path / "out", tmp_path)
    state = tmp_path / "trainer_state.json"
    # no global_step (KeyError), not a number (ValueError), null (TypeError), not JSON (ValueError)
    for text in ('{"epoch": 1}', '{"global_step": "x"}', '{"global_step": null}', "{"):
        state.write_text(text)
        with pytest.raises(ValueError, match="^" + re.escape(f"resume={str(tmp_path)!r}: {state} cannot be read (")
                           + ".+" + re.escape("); resume from another checkpoint") + "$") as raised:
            check_resume_target(tmp_path / "out", tmp_path)
        assert raised.value.__cause__ is None and raised.value.__suppress_context__


# ----------------------------------------------------------------------------------------------------- lineages


def test_lineages(tmp_path):
    first, second = new_lineage(), new_lineage()
    assert re.fullmatch(r"[0-9a-f]{32}", first) and first != second
    assert checkpoint_lineage(tmp_path / "missing") is None
    checkpoint_at(tmp_path / "a", 1, lineage=first)
    assert checkpoint_lineage(tmp_path / "a") == first
    assert checkpoint_lineage(str(tmp_path / "a")) == first
    checkpoint_at(tmp_path / "b", 1, lineage=3)
    assert checkpoint_lineage(tmp_path / "b") is None  # not a string
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "trainer_state.json").write_text("[1, 2]")  # not an object
    assert checkpoint_lineage(tmp_path / "c") is None
    (tmp_path / "c" / "trainer_state.json").write_text("{")
    assert checkpoint_lineage(tmp_path / "c") is None


def test_save_stores_the_lineage_and_prunes_only_its_own(tmp_path):
    _, optimizer = optimizer_of()
    other = new_lineage()
    save(tmp_path, 1, optimizer, lineage=other)
    save(tmp_path, 2, optimizer)  # (no lineage: written before lineages existed)
    ours = new_lineage()
    for step in (3, 4, 5):
        path = save(tmp_path, step, optimizer, lineage=ours, keep_last=2)
    assert json.loads((path / "trainer_state.json").read_text()) == {"global_step": 5, "lineage": ours}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-4",
                                                          "checkpoint-5"]
    # without a lineage every numbered checkpoint counts
    save(tmp_path, 6, optimizer, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6"]


# ------------------------------------------------------------------------------------------------- temporaries


def test_remove_temporaries(tmp_path, caplog):
    assert remove_temporaries(tmp_path / "missing") == []
    for name in (".tmp-delete-checkpoint-3-9", ".tmp-checkpoint-4-9", "checkpoint-2", ".tmp-other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    (tmp_path / ".tmp-checkpoint-file").write_text("a file is left")
    with caplog.at_level(logging.WARNING, logger="diffalign.runtime.checkpoint"):
        removed = remove_temporaries(str(tmp_path))
    assert removed == [tmp_path / ".tmp-checkpoint-4-9", tmp_path / ".tmp-delete-checkpoint-3-9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-checkpoint-file", ".tmp-other", "checkpoint-2"]
    assert caplog.messages == [f"removed {p}, left by a run that was killed while writing a checkpoint"
                               for p in removed]


# ------------------------------------------------------------------------------------------------ save, verify


def test_save_argument_messages_and_a_stale_temporary(tmp_path):
    _, optimizer = optimizer_of()
    with pytest.raises(ValueError, match=exact("step=-1 must be ≥ 0.")):
        save(tmp_path, -1, optimizer)
    for keep_last in (0, -2):
        with pytest.raises(ValueError, match=exact(f"keep_last={keep_last} must be -1 (keep all) or ≥ 1.")):
            save(tmp_path, 1, optimizer, keep_last=keep_last)
    assert not (tmp_path / "checkpoint-1").exists()
    save(tmp_path, 0, optimizer)  # step 0 is a step
    with pytest.raises(FileExistsError, match=exact(
            f"{tmp_path / 'checkpoint-0'} already exists; delete it or resume from it instead of saving step 0 "
            "again.")):
        save(tmp_path, 0, optimizer)
    stale = tmp_path / f".tmp-checkpoint-7-{os.getpid()}"  # left by this very process: replaced
    stale.mkdir()
    (stale / "junk").write_text("x")
    path = save(tmp_path, 7, optimizer)
    assert not (path / "junk").exists() and not stale.exists()
    with pytest.raises(TypeError, match="^" + re.escape("trainer state is not JSON-serialisable (") + ".*"
                       + re.escape("); store plain numbers/strings/lists.") + "$"):
        save(tmp_path, 8, optimizer, state={"x": {1, 2}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0", "checkpoint-7"]
    nested = tmp_path / "new" / "run"
    assert save(nested, 1, optimizer) == nested / "checkpoint-1"  # folders created as needed


def test_a_full_disk_says_so_with_the_size_of_the_last_checkpoint(tmp_path):
    _, optimizer = optimizer_of()
    first = save(tmp_path, 1, optimizer)
    size = sum(f.stat().st_size for f in first.iterdir())

    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError) as raised:
        save_checkpoint(tmp_path, 2, lora_dir_writer=full, optimizer=optimizer, lr_scheduler=None, state={})
    assert (raised.value.folder, raised.value.what, raised.value.needed) == (tmp_path, "checkpoint-2", size)
    assert raised.value.__cause__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    empty = tmp_path / "empty"
    with pytest.raises(DiskFullError) as raised:
        save_checkpoint(empty, 0, lora_dir_writer=full, optimizer=optimizer, lr_scheduler=None, state={})
    assert raised.value.needed is None and list(empty.iterdir()) == []


def test_verify_names_the_missing_or_damaged_file(tmp_path):
    _, optimizer = optimizer_of()
    paths = [save(tmp_path, step, optimizer) for step in (1, 2, 3, 4)]
    verify_checkpoint(paths[-1])
    for name in ("trainer_state.json", "optimizer.json", "rng_state.json", "rng_state.safetensors"):
        copy = tmp_path / f"copy-{name}"
        copy.mkdir()
        for file in paths[0].iterdir():
            if file.name != name:
                (copy / file.name).write_bytes(file.read_bytes())
        with pytest.raises(FileNotFoundError, match=exact(
                f"{copy} is not a complete checkpoint directory (no {name}); pass a checkpoint-<step> folder written "
                "by diffalign-train")):
            verify_checkpoint(copy)
    damaged = paths[-1] / "optimizer.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-3])
    with pytest.raises(ValueError, match="^" + re.escape(f"{damaged} is truncated or damaged (") + ".*" + re.escape(
            f"); delete {paths[-1]} (resume=latest then continues from checkpoint-3), or branch from an earlier "
            f"checkpoint into a new folder (output_dir=<new folder> resume=<checkpoint>; in {tmp_path}: "
            "['checkpoint-1', 'checkpoint-2', 'checkpoint-3'])") + "$"):
        verify_checkpoint(paths[-1])
    (paths[0] / "trainer_state.json").write_text("{")
    with pytest.raises(ValueError, match=re.escape(
            f"(then start again), or branch from an earlier checkpoint into a new folder (output_dir=<new folder> "
            f"resume=<checkpoint>; in {tmp_path}: none)")):
        verify_checkpoint(paths[0])
    with pytest.raises(ValueError, match=re.escape(f"{paths[-1]} (resume=latest then continues from checkpoint-3)")):
        load_checkpoint(paths[-1], optimizer=optimizer, lr_scheduler=None)  # verified before anything is restored


def test_cuda_rng_states_without_cuda_are_reported_and_skipped(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    _, optimizer = optimizer_of()
    path = save(tmp_path, 1, optimizer)
    rng = load_file(str(path / "rng_state.safetensors"))
    save_file({**rng, "cuda.0": torch.zeros(16, dtype=torch.uint8)}, str(path / "rng_state.safetensors"))
    with caplog.at_level(logging.WARNING, logger="diffalign.runtime.checkpoint"):
        state = load_checkpoint(path, optimizer=optimizer, lr_scheduler=None)
    assert state == {"global_step": 1}
    assert caplog.messages == [f"{path} holds CUDA RNG states but CUDA is not available; they are not restored."]
    caplog.clear()
    save_file(rng, str(path / "rng_state.safetensors"))
    with caplog.at_level(logging.WARNING, logger="diffalign.runtime.checkpoint"):
        load_checkpoint(path, optimizer=optimizer, lr_scheduler=None)
    assert caplog.messages == []


def test_the_optimizer_state_comes_back(tmp_path):
    _, optimizer = optimizer_of(0)
    path = save(tmp_path, 1, optimizer)
    _, other = optimizer_of(1)
    load_checkpoint(path, optimizer=other, lr_scheduler=None)
    for a, b in zip(optimizer.state_dict()["state"].values(), other.state_dict()["state"].values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_a_tuple_of_tensors_comes_back(tmp_path):
    x = torch.tensor([1.0, 2.0])
    write_state({"t": (x, 1)}, tmp_path, "s")
    back = read_state(tmp_path, "s")["t"]
    assert isinstance(back, tuple) and torch.equal(back[0], x) and back[1] == 1


def test_the_damaged_message_lists_the_last_three_earlier_checkpoints(tmp_path):
    _, optimizer = optimizer_of()
    paths = [save(tmp_path, step, optimizer) for step in (1, 2, 3, 4, 5)]
    (paths[-1] / "rng_state.json").write_text("{")
    with pytest.raises(ValueError, match=re.escape(
            f"in {tmp_path}: ['checkpoint-2', 'checkpoint-3', 'checkpoint-4'])")):
        verify_checkpoint(paths[-1])


def test_cuda_rng_states_are_restored_on_as_many_devices(tmp_path, monkeypatch):
    """(CUDA faked: two saved device states; restored when two devices are visible, refused with one.)"""
    _, optimizer = optimizer_of()
    path = save(tmp_path, 1, optimizer)
    rng = load_file(str(path / "rng_state.safetensors"))
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(2)]
    save_file({**rng, "cuda.0": states[0], "cuda.1": states[1]}, str(path / "rng_state.safetensors"))
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda new: restored.append(list(new)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    load_checkpoint(path, optimizer=optimizer, lr_scheduler=None)
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], states, strict=True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"{path} holds CUDA RNG states of 2 devices but 1 are visible; resume with the same CUDA_VISIBLE_DEVICES.")
            + "$"):
        load_checkpoint(path, optimizer=optimizer, lr_scheduler=None)
    assert len(restored) == 1


def test_a_fresh_optimizer_still_writes_its_tensor_file_and_cuda_states_are_saved(tmp_path, monkeypatch):
    """The layout of the module docstring: ``optimizer.safetensors`` even before the optimizer has state; with CUDA
    (faked here) one ``cuda.<i>`` RNG state per device beside ``torch_cpu``."""
    model = torch.nn.Linear(2, 1)
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    path = save(tmp_path, 1, fresh)
    assert load_file(str(path / "optimizer.safetensors")) == {}
    states = [torch.full((16,), i, dtype=torch.uint8) for i in (3, 4)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    path = save(tmp_path, 2, fresh)
    saved = load_file(str(path / "rng_state.safetensors"))
    assert sorted(saved) == ["cuda.0", "cuda.1", "torch_cpu"]
    assert torch.equal(saved["cuda.0"], states[0]) and torch.equal(saved["cuda.1"], states[1])


def test_a_failure_that_took_the_temporary_folder_keeps_its_own_error(tmp_path, caplog):
    """The clean-up ignores a temporary folder that is already gone, so the caller sees the original error; a saved
    checkpoint is logged by path."""
    _, optimizer = optimizer_of()

    def writer(directory):
        directory.rmdir()
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError, match="^the writer failed$"):
        save_checkpoint(tmp_path, 3, lora_dir_writer=writer, optimizer=optimizer, lr_scheduler=None, state={})
    assert list(tmp_path.iterdir()) == []
    with caplog.at_level(logging.INFO, logger="diffalign.runtime.checkpoint"):
        path = save(tmp_path, 4, optimizer)
    assert caplog.messages == [f"saved checkpoint {path}"]


def test_keep_last_skips_the_checkpoint_just_saved_and_goes_on_deleting_and_logs_each(tmp_path, caplog):
    """keep_last=1 with checkpoints 5000 and 6000 left by an earlier run and step 100 saved now: the highest step
    (6000) and the one just written (100) are kept, so 5000 goes, although it comes after 100 in step order; each
    removal is logged with its path and keep_last."""
    _, optimizer = optimizer_of()
    for step in (5000, 6000):
        save(tmp_path, step, optimizer)
    with caplog.at_level(logging.INFO, logger="diffalign.runtime.checkpoint"):
        path = save(tmp_path, 100, optimizer, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-100", "checkpoint-6000"] and path.is_dir()
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed")]
    assert removed == [f"removed old checkpoint {tmp_path / 'checkpoint-5000'} (keep_last=1)"]
