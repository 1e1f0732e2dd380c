"""One validation pass and one build per run (issue 30 item 4, issue 32 item 1): `diffalign.train.prepare.prepare_run`
checks every node once and builds every component once; the loops take the built run; the run lock is taken once."""

from __future__ import annotations

import pytest
from conftest import compose_cfg, smoke_overrides

from diffalign.train import prepare


def _count(monkeypatch, owner, name: str, calls: dict, key: str) -> None:
    """Wraps ``owner.name`` so that each call adds 1 to ``calls[key]``."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[key] = calls.get(key, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _counters(monkeypatch) -> dict:
    """Counts the checks and the constructors a run goes through (patched where they are looked up)."""
    import diffalign.train.prepare as prepare_module
    from diffalign.config import validation
    from diffalign.data import shapes_pairs
    from diffalign.lora import initial
    from diffalign.objectives import diffusion_dpo
    from diffalign.reference import frozen_base
    from diffalign.runtime import runlock
    from diffalign.train import common

    calls: dict[str, int] = {}
    _count(monkeypatch, prepare_module, "validate_train_config", calls, "validate_train_config")
    _count(monkeypatch, validation, "check_method_config", calls, "check_method_config")
    _count(monkeypatch, initial, "build_policy", calls, "build_policy")
    _count(monkeypatch, common, "build_reward_sets", calls, "build_reward_sets")
    _count(monkeypatch, common, "make_accelerator", calls, "make_accelerator")
    _count(monkeypatch, runlock, "acquire", calls, "lock")
    for key, cls in (("method", diffusion_dpo.DiffusionDPO), ("reference", frozen_base.FrozenBaseReference),
                     ("data", shapes_pairs.ShapesPairs)):
        _count(monkeypatch, cls, "__init__", calls, key)
    return calls


def test_a_python_run_is_checked_built_and_locked_exactly_once(tmp_path, monkeypatch):
    """``train(cfg)`` from Python: every check and every constructor once, one lock (validation used to build the
    method and the reference, and the loop built them again; migrate_config ran three times, the lock twice)."""
    from diffalign.train.preference import train

    cfg = compose_cfg(smoke_overrides(tmp_path / "run", steps=1))
    calls = _counters(monkeypatch)
    results = train(cfg)
    assert results["global_step"] == 1
    assert calls == {"validate_train_config": 1, "check_method_config": 1, "build_policy": 1,
                     "build_reward_sets": 1, "make_accelerator": 1, "lock": 1, "method": 1, "reference": 1,
                     "data": 1}


def test_a_command_line_run_takes_the_lock_once(tmp_path, monkeypatch):
    """``diffalign-train``: the Hydra callback holds the lock; the loop, given the prepared run, takes none."""
    from diffalign.runtime.runlock import RunLockCallback
    from diffalign.train.preference import train

    cfg = compose_cfg(smoke_overrides(tmp_path / "run", steps=1))
    calls = _counters(monkeypatch)
    callback = RunLockCallback("diffalign-train")
    callback.on_run_start(cfg)
    try:
        train(prepare.prepare_run(cfg))
    finally:
        callback.on_run_end(cfg)
    assert calls["lock"] == 1 and calls["method"] == 1 and calls["validate_train_config"] == 1
    assert not (tmp_path / "run" / ".diffalign.lock").exists()  # released at the end


def test_a_loop_refuses_a_run_of_the_other_loop(tmp_path):
    from diffalign.train.online import train

    cfg = compose_cfg(smoke_overrides(tmp_path / "run", steps=1))
    with pytest.raises(ValueError, match="is not an online method; train it with diffalign.train.preference.train"):
        train(cfg)
