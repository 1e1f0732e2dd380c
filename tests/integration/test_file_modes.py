"""Every file of a run has the mode the umask gives (``0o666 & ~umask``), so a group member who can read a shared
run's LoRA can also resume it (issue 32, item 5): safetensors 0.8 writes its files 0600 whatever the umask, which made
the optimizer, RNG and reference states and the prepared data chunks private while the LoRA and JSON files were not.
A real ``diffalign-train`` process under umask 027 (group may read, others nothing)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from conftest import CHILD_ENV

from diffalign.runtime.files import save_safetensors

UMASK = 0o027


def modes(root) -> dict[str, int]:
    """Relative path → permission bits of every regular file under `root`."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_save_safetensors_gives_the_umask_mode(tmp_path):
    import torch
    from safetensors.torch import save_file

    old = os.umask(UMASK)
    try:
        save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
        save_safetensors({"x": torch.zeros(2)}, tmp_path / "ours.safetensors")
        (tmp_path / "open.json").write_text("{}")
    finally:
        os.umask(old)
    found = modes(tmp_path)
    assert found["open.json"] == 0o640  # what open() gives under umask 027: the reference
    assert found["ours.safetensors"] == found["open.json"]
    assert found["plain.safetensors"] == 0o600  # the cause (if safetensors changes this, the helper stays harmless)


@pytest.mark.slow
def test_every_file_of_a_real_run_has_the_umask_mode(tmp_path):
    run = tmp_path / "run"
    overrides = [f"output_dir={run}", "data=ranked_pairs", "data.num_prompts=2", "data.samples_per_prompt=4",
                 "data.batch_size=4", "data.sampler.num_inference_steps=2", "data.reward=geneval_shapes", "model=tiny_random",
                 "reference=ema", "trainer.max_steps=1", "trainer.batch_size=2", "trainer.checkpointing_steps=1",
                 "trainer.log_with=none", "eval.enabled=false"]
    code = "import sys; from diffalign.cli import train; sys.argv = ['diffalign-train'] + sys.argv[1:]; train()"
    done = subprocess.run([sys.executable, "-c", code, *overrides], cwd=tmp_path, env=CHILD_ENV, umask=UMASK,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = modes(run)
    kinds = {name.rsplit("/", 1)[-1] for name in found}
    # the files that were 0600: optimizer, RNG and reference states, prepared chunks
    assert {"optimizer.safetensors", "rng_state.safetensors", "pytorch_lora_weights.safetensors"} <= kinds
    assert any(name.startswith("reference_state") and name.endswith(".safetensors") for name in kinds), kinds
    assert any("/chunk-" in name for name in found), sorted(found)
    wrong = {name: oct(mode) for name, mode in found.items() if mode != 0o666 & ~UMASK}
    assert not wrong, wrong
