"""Exact resume of every training loop on CPU (issue 10 item 1): run A goes straight to the end; run B starts from a
copy of one of A's intermediate checkpoints (the same config, as if A had been stopped there), resumes with
resume=latest and must end with the same weights, optimizer, reference and trainer state, bit for bit.

Already covered elsewhere: Diffusion-DPO with the frozen base (test_cli::test_resume_continues_exactly), SePPO with
the reference pool (test_seppo::test_resume_continues_exactly_with_the_pool), DGPO on the flow model
(test_online::test_resume_continues_exactly), a resume after SIGTERM and after SIGKILL mid-save (test_faults).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import ONLINE_CASES as CASES
from conftest import compose_cfg, online_overrides, smoke_overrides
from safetensors.torch import load_file

PREFERENCE = {
    "sft": ["method=sft", "data=shapes_winners", "data.num_samples=16"],
    "dpo_ema_reference": ["method=diffusion_dpo", "reference=ema", "reference.decay=0.5"],
    "dpo_accumulation_cosine": ["method=diffusion_dpo", "trainer.gradient_accumulation_steps=2",
                                "trainer.lr_scheduler=cosine"],
}


def assert_same_files(a, b, names):
    for name in names:
        if name.endswith(".safetensors"):
            x, y = load_file(a / name), load_file(b / name)
            assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x), name
        else:
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


@pytest.mark.parametrize("case", sorted(PREFERENCE))
def test_preference_loop_resumes_exactly(case, tmp_path):
    from diffalign.train.preference import train

    def overrides(run, steps):
        base = [o for o in smoke_overrides(tmp_path / run, steps=steps) if not (case == "sft" and o.startswith("data."))]
        return base + PREFERENCE[case]

    train(compose_cfg(overrides("a", 4)))
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")  # as if stopped after step 2
    results = train(compose_cfg(overrides("b", 4) + ["resume=latest"]))
    assert results["global_step"] == 4
    assert_same_files(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors", "reference_state.safetensors",
                       "reference_state.json", "trainer_state.json", "scheduler.json"])


def test_preference_resume_in_a_later_epoch_refills_the_latent_cache_exactly(tmp_path):
    """A resume after step 10 of 30 (16 pairs, batch 2: 8 steps per epoch). From then on the uninterrupted run takes
    its latents from its cache, encoded in epoch 1's batches; a resumed run that encoded them in the later batches
    instead ended 1.2e-5 away (a VAE's output on CPU changes at float rounding with its batch's other images): the
    resume must refill the cache in the original batches (`LatentCache.refill`)."""
    from diffalign.train.preference import train

    overrides = lambda run: smoke_overrides(tmp_path / run, steps=30) + ["trainer.checkpointing_steps=10"]
    train(compose_cfg(overrides("a")))
    shutil.copytree(tmp_path / "a" / "checkpoint-10", tmp_path / "b" / "checkpoint-10")
    results = train(compose_cfg(overrides("b") + ["resume=latest"]))
    assert results["global_step"] == 30
    assert_same_files(tmp_path / "a" / "checkpoint-30", tmp_path / "b" / "checkpoint-30",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors", "trainer_state.json"])


@pytest.mark.parametrize("case", ["dgpo_sd", "flow_grpo_sd", "ddpo_sd"])
def test_online_loop_resumes_exactly(case, tmp_path):
    from diffalign.train.online import train

    full = train(compose_cfg(CASES[case] + online_overrides(tmp_path / "a", epochs=3)))
    first = json.loads((tmp_path / "a" / "history.jsonl").read_text().splitlines()[0])["step"]  # after epoch 1
    shutil.copytree(tmp_path / "a" / f"checkpoint-{first}", tmp_path / "b" / f"checkpoint-{first}")
    resumed = train(compose_cfg(CASES[case] + online_overrides(tmp_path / "b", epochs=3) + ["resume=latest"]))
    assert resumed["global_step"] == full["global_step"]
    step = full["global_step"]
    assert_same_files(tmp_path / "a" / f"checkpoint-{step}", tmp_path / "b" / f"checkpoint-{step}",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors", "trainer_state.json"])
    last_a = json.loads((tmp_path / "a" / "history.jsonl").read_text().splitlines()[-1])
    last_b = json.loads((tmp_path / "b" / "history.jsonl").read_text().splitlines()[-1])
    assert last_a["loss"] == last_b["loss"] and last_a["reward/mean"] == last_b["reward/mean"]


@pytest.mark.parametrize("case", ["dgpo_sd", "flow_grpo_sd"])
def test_a_finished_online_run_extended_to_more_epochs_equals_a_run_of_that_many(case, tmp_path):
    """``online.num_epochs=<more> output_dir=<a finished run> resume=latest`` continues it: with the default constant
    LR schedule every stream is seeded by (seed, epoch), so 2 epochs then 1 more end bit for bit where 3 epochs end
    (how the GenEval recipes' 48-epoch runs continued their 24-epoch ones, docs/results/tiny_world.md)."""
    from diffalign.train.online import train

    full = train(compose_cfg(CASES[case] + online_overrides(tmp_path / "a", epochs=3)))
    train(compose_cfg(CASES[case] + online_overrides(tmp_path / "b", epochs=2)))
    extended = train(compose_cfg(CASES[case] + online_overrides(tmp_path / "b", epochs=3) + ["resume=latest"]))
    assert extended["global_step"] == full["global_step"]
    step = full["global_step"]
    assert_same_files(tmp_path / "a" / f"checkpoint-{step}", tmp_path / "b" / f"checkpoint-{step}",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors"])
    states = [json.loads((tmp_path / run / f"checkpoint-{step}" / "trainer_state.json").read_text()) for run in "ab"]
    assert states[0].pop("lineage") != states[1].pop("lineage")  # (two runs: each its own lineage id)
    assert states[0] == states[1]
    assert_same_files(tmp_path / "a" / "final", tmp_path / "b" / "final", ["pytorch_lora_weights.safetensors"])
    history = [[{k: v for k, v in json.loads(line).items() if not k.endswith("seconds")}  # (wall times differ)
                for line in (tmp_path / run / "history.jsonl").read_text().splitlines()] for run in "ab"]
    assert len(history[0]) == 3 and history[0] == history[1]


def test_resume_from_an_earlier_checkpoint_of_the_folder_is_refused_and_branching_elsewhere_continues_it(tmp_path):
    """``resume=<checkpoint-1>`` into a folder that holds checkpoint-2 and -3 (issue 19, a raw FileExistsError at the
    first save before): refused before any model loads, by validation and by the loop, naming the later checkpoints
    and the fix, with every checkpoint kept. The fix, a new output_dir with the same resume, continues step 1 exactly
    (its checkpoint-3 equals the first run's) and carries the lineage on."""
    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path / "a", steps=3)))
    before = sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*"))
    earlier = tmp_path / "a" / "checkpoint-1"
    cfg = compose_cfg(smoke_overrides(tmp_path / "a", steps=3) + [f"resume={earlier}"])
    match = (r"resume='.*checkpoint-1' continues from step 1, but output_dir='.*a' already holds later checkpoints "
             r"\(checkpoint-2, checkpoint-3\).*pass a new output_dir=<folder> with the same resume=")
    with pytest.raises(ValueError, match=match):
        validate_train_config(cfg)
    with pytest.raises(ValueError, match=match):  # (a run started from Python, without validation)
        train(cfg)
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == before
    validate_train_config(compose_cfg(smoke_overrides(tmp_path / "a", steps=3) +  # the newest: fine
                                      [f"resume={tmp_path / 'a' / 'checkpoint-3'}"]))
    branch = compose_cfg(smoke_overrides(tmp_path / "b", steps=3) + [f"resume={earlier}"])
    validate_train_config(branch)
    train(branch)
    assert_same_files(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors", "trainer_state.json"])
    assert sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*")) == before
