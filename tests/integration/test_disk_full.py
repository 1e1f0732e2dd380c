"""A full disk (issue 32 item 3) in every phase of a run: the checkpoint save, the data preparation, the evaluation's
images and metrics, the final LoRA (and diffalign-export). Each ends the command with one line naming the folder and
what was being written (and the space needed where it is known), leaves nothing half-written behind (no 0-byte image,
no temporary file or folder), and ``resume=latest`` (or the same command) finishes the run once space is freed.

The full disk is injected into the writers (an ``OSError(ENOSPC)`` after a partial write, or safetensors' own error
text), as a real full disk raises it; tests/integration/test_disk_full.py::test_a_real_full_tmpfs_ends_diffalign_eval_with_one_line also fills a real tmpfs where
this machine lets the test mount one.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CHILD_ENV, REPO, compose_cfg, smoke_overrides
from PIL import Image
from safetensors import SafetensorError

from diffalign.runtime.storage import DiskFullError, format_bytes, is_disk_full

PREP = ["data=ranked_pairs", "data.num_prompts=4", "data.samples_per_prompt=4", "data.batch_size=2",
        "data.sampler.num_inference_steps=2", "data.reward=geneval_shapes"]
EVAL = ["model=tiny_random", "eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=2",
        "eval.batch_size=1", "report=false"]


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def leftovers(folder: Path) -> list[Path]:
    """Temporary files or folders (``.tmp-*``, ``*.tmp``) anywhere under `folder`."""
    return [p for p in folder.rglob("*") if p.name.startswith(".tmp") or p.name.endswith(".tmp")]


def bytes_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in files_under(folder))


def patch_save_file(monkeypatch, fake) -> None:
    """Puts `fake` in place of safetensors' ``save_file`` everywhere diffalign may call it: the module attribute (read
    at call time) and the names bound by ``from safetensors.torch import save_file`` in modules already imported (the
    training loops are imported first, so that none binds the fake for later)."""
    import sys

    import safetensors.torch

    import diffalign.data.resumable
    import diffalign.train.online
    import diffalign.train.preference  # noqa: F401

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", fake)
    for name, module in list(sys.modules.items()):
        if name.startswith("diffalign") and getattr(module, "save_file", None) is real:
            monkeypatch.setattr(module, "save_file", fake)


def exit_line(call) -> str:
    """Runs `call`, which must exit with a message; returns that message (one line)."""
    with pytest.raises(SystemExit) as info:
        call()
    message = str(info.value.code)
    assert "\n" not in message and "Traceback" not in message, message
    return message


def test_is_disk_full_knows_the_three_shapes_of_a_full_disk():
    assert is_disk_full(enospc()) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    try:
        try:
            raise enospc()
        except OSError as err:
            raise RuntimeError("while saving") from err
    except RuntimeError as chained:
        assert is_disk_full(chained)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(ValueError("x"))
    assert format_bytes(1536) == "1.5 KB" and format_bytes(3 * 1024**2) == "3.0 MB" and format_bytes(12) == "12 B"


def test_a_full_disk_at_a_checkpoint_save_is_one_line_and_resume_continues(tmp_path, monkeypatch, release_run_locks):
    import safetensors.torch

    from diffalign.cli import _train_main

    real = safetensors.torch.save_file

    def full_at_step_2(tensors, filename, *args, **kwargs):  # the optimizer file of checkpoint-2: half written, then full
        if ".tmp-checkpoint-2-" in str(filename) and str(filename).endswith("optimizer.safetensors"):
            Path(filename).write_bytes(b"\0" * 100)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    patch_save_file(monkeypatch, full_at_step_2)
    line = exit_line(lambda: _train_main(compose_cfg(smoke_overrides(tmp_path))))
    need = format_bytes(bytes_of(tmp_path / "checkpoint-1"))  # the size of the checkpoint before it
    assert line.startswith(f"diffalign: error: no space left on the disk of {tmp_path} while writing checkpoint-2 (")
    assert f"about {need} needed" in line and line.endswith(f"continue with output_dir={tmp_path} resume=latest"), line
    assert (tmp_path / "checkpoint-1").is_dir() and not (tmp_path / "checkpoint-2").exists()
    assert leftovers(tmp_path) == [] and not (tmp_path / "final").exists()

    monkeypatch.undo()  # space freed
    from diffalign.train.preference import train

    results = train(compose_cfg(smoke_overrides(tmp_path) + ["resume=latest"]))
    assert results["global_step"] == 2 and (tmp_path / "checkpoint-2" / "optimizer.safetensors").is_file()


def test_a_full_disk_in_the_data_preparation_keeps_the_chunks_made_and_resume_finishes(tmp_path, monkeypatch,
                                                                                       release_run_locks):
    import safetensors.torch

    from diffalign.cli import _train_main

    real, calls = safetensors.torch.save_file, []

    def full_at_chunk_3(tensors, filename, *args, **kwargs):
        if "chunk-" in str(filename):
            calls.append(filename)
        if "chunk-" in str(filename) and len(calls) == 3:
            Path(filename).write_bytes(b"\0" * 64)  # a partial chunk, then the disk is full
            raise enospc()
        return real(tensors, filename, *args, **kwargs)

    patch_save_file(monkeypatch, full_at_chunk_3)
    overrides = [o for o in smoke_overrides(tmp_path) if not o.startswith("data")] + PREP
    line = exit_line(lambda: _train_main(compose_cfg(overrides)))
    folder = next((tmp_path / "prepared").iterdir())
    chunks = sorted(folder.glob("chunk-*.safetensors"))
    assert len(chunks) == 2  # 16 samples in chunks of 2: 8 chunks, the third failed
    need = format_bytes(round(sum(c.stat().st_size for c in chunks) / 2 * 6))  # the 6 missing at the mean size
    assert line.startswith(f"diffalign: error: no space left on the disk of {folder} while writing chunk 3 of 8 of "
                           "the on-policy data ("), line
    assert f"about {need} needed" in line and line.endswith(f"continue with output_dir={tmp_path} resume=latest")
    assert leftovers(tmp_path) == [] and not list(tmp_path.glob("checkpoint-*"))

    monkeypatch.undo()
    from diffalign.train.preference import train

    results = train(compose_cfg(overrides + ["resume=latest"]))
    assert results["global_step"] == 2 and len(list(folder.glob("chunk-*.safetensors"))) == 8


@pytest.mark.parametrize("where", ["image", "metrics"])
def test_a_full_disk_in_the_evaluation_leaves_no_partial_file_and_a_rerun_finishes(tmp_path, monkeypatch, where):
    from diffalign.cli import _eval_main

    out_dir = tmp_path / "ev"
    real_save, real_write, saved = Image.Image.save, Path.write_text, []

    def full_at_third_image(self, fp, *args, **kwargs):
        saved.append(fp)
        if len(saved) == 3:
            Path(fp).write_bytes(b"")  # Pillow opens the file first: a full disk left a 0-byte PNG
            raise enospc()
        return real_save(self, fp, *args, **kwargs)

    def full_at_metrics(self, data, *args, **kwargs):
        if self.name.endswith("metrics.json"):
            real_write(self, data[:10], *args, **kwargs)
            raise enospc()
        return real_write(self, data, *args, **kwargs)

    if where == "image":
        monkeypatch.setattr(Image.Image, "save", full_at_third_image)
    else:
        monkeypatch.setattr(Path, "write_text", full_at_metrics)
    line = exit_line(lambda: _eval_main(compose_cfg([f"output_dir={out_dir}", *EVAL], name="evaluate")))
    if where == "image":
        third = out_dir / "images" / "base" / "p00002_s0.png"
        assert line.startswith(f"diffalign: error: no space left on the disk of {third.parent} while writing {third}")
        assert not third.exists()
    else:
        assert line.startswith(f"diffalign: error: no space left on the disk of {out_dir} while writing "
                               f"{out_dir / 'metrics.json'}")
        assert not (out_dir / "metrics.json").exists()
    assert line.endswith("then run the same command again to continue"), line
    assert leftovers(out_dir) == []
    for png in out_dir.rglob("*.png"):  # every image kept is whole
        with Image.open(png) as image:
            image.verify()

    monkeypatch.undo()  # space freed: the same command finishes
    _eval_main(compose_cfg([f"output_dir={out_dir}", *EVAL], name="evaluate"))
    assert (out_dir / "metrics.json").is_file() and leftovers(out_dir) == []


def test_a_full_disk_at_the_final_lora_leaves_no_partial_file_and_resume_writes_it(tmp_path, monkeypatch,
                                                                                  release_run_locks):
    from diffalign.cli import _train_main
    from diffalign.models.pipeline_policy import PipelinePolicy
    from diffalign.train.preference import train

    real = PipelinePolicy.save_lora_weights

    def full_at_final(self, directory):
        if Path(directory).name.endswith("final"):
            (Path(directory) / "pytorch_lora_weights.safetensors").write_bytes(b"\0" * 100)
            raise enospc()
        return real(self, directory)

    monkeypatch.setattr(PipelinePolicy, "save_lora_weights", full_at_final)
    line = exit_line(lambda: _train_main(compose_cfg(smoke_overrides(tmp_path))))
    assert line.startswith(f"diffalign: error: no space left on the disk of {tmp_path} while writing the final LoRA "
                           "(final/) ("), line
    # the adapter's float32 matrices: the LoRA file of the last checkpoint holds the same tensors (plus its header)
    lora = (tmp_path / "checkpoint-2" / "pytorch_lora_weights.safetensors").stat().st_size
    needed = line.split("about ")[1].split(" needed")[0]
    assert needed == format_bytes(lora - 8 - int.from_bytes((tmp_path / "checkpoint-2" /
                                                              "pytorch_lora_weights.safetensors").read_bytes()[:8],
                                                             "little"))
    assert not (tmp_path / "final" / "pytorch_lora_weights.safetensors").exists() and leftovers(tmp_path) == []

    monkeypatch.setattr(PipelinePolicy, "save_lora_weights", real)
    results = train(compose_cfg(smoke_overrides(tmp_path) + ["resume=latest"]))
    assert results["global_step"] == 2
    from safetensors.torch import load_file

    final, last = (load_file(str(tmp_path / d / "pytorch_lora_weights.safetensors")) for d in ("final", "checkpoint-2"))
    assert final.keys() == last.keys() and all(final[k].equal(last[k]) for k in final)


def test_a_full_disk_in_diffalign_export_leaves_no_partial_file(tmp_path, tiny_policy, monkeypatch):
    import safetensors.torch

    from diffalign.lora.export import main

    tiny_policy.save_lora_weights(tmp_path / "run")

    def full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\0" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    destination = tmp_path / "out" / "exported.safetensors"
    line = exit_line(lambda: main([str(tmp_path / "run"), str(destination)]))
    assert line.startswith(f"diffalign-export: error: no space left on the disk of {destination.parent} while "
                           "writing the exported LoRA exported.safetensors"), line
    assert not destination.exists() and leftovers(tmp_path) == []
    monkeypatch.undo()
    main([str(tmp_path / "run"), str(destination)])
    assert destination.is_file()


def _can_mount_tmpfs(folder: Path) -> bool:
    if os.geteuid() != 0:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True,
                          check=False)
    return done.returncode == 0


def test_a_real_full_tmpfs_ends_diffalign_eval_with_one_line(tmp_path):
    """A real full disk (a 64 KB tmpfs; skipped where this process cannot mount one): diffalign-eval as a subprocess
    exits 1 with one line and no traceback, and leaves no empty or temporary file."""
    mount = tmp_path / "small"
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out_dir = mount / "ev"
        eval_args = [a for a in EVAL if not a.startswith("eval.prompts_per_tag")] + ["eval.prompts_per_tag=4"]
        code = "import sys; from diffalign.cli import evaluate; sys.argv = ['diffalign-eval'] + sys.argv[1:]; evaluate()"
        done = subprocess.run([sys.executable, "-c", code, f"output_dir={out_dir}", "hydra.run.dir=" + str(tmp_path),
                               *eval_args], cwd=REPO, env=CHILD_ENV, capture_output=True, text=True, timeout=600,
                              check=False)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert last.startswith("diffalign: error: no space left on the disk of ") and str(out_dir) in last, last
        assert leftovers(mount) == [] and all(p.stat().st_size > 0 for p in files_under(mount))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_disk_full_error_is_an_oserror_with_the_folder_and_the_free_space(tmp_path):
    err = DiskFullError(tmp_path, "x.bin", needed=2048)
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.folder == tmp_path
    assert re.match(rf"no space left on the disk of {re.escape(str(tmp_path))} while writing x.bin \(\d+\.\d [KMG]B "
                    r"free, about 2\.0 KB needed\); nothing partial was kept\. Free space there .*, then continue with "
                    r"resume=latest$", str(err)), str(err)
    err.hint = "run the same command again to continue"
    assert str(err).endswith("then run the same command again to continue")
