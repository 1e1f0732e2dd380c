"""The stronger tiny bases' pretraining as one command for a GPU machine (maintenance tool; never imported).

Runs three pretrainings at once, as separate processes on one device, each under ``timeout``, each with
``--checkpoint-minutes 1 --resume``:

* ``flow2`` — ``scripts/pretrain_tiny_world.py flow2`` (the stronger SD3-format base, issue 34);
* ``flux2`` — ``scripts/pretrain_tiny_world.py flux2`` (the stronger FLUX.1-format base, issue 31);
* ``wan``   — ``scripts/pretrain_tiny_video.py --arch wan`` (the Wan 2.1-format video base: the VAE stage, then the
  transformer stage; the VAE stage is skipped once ``wan/wan_vae`` exists).

Each writes its work folder ``$WORK_ROOT/<stage>`` (checkpoints, latents cache, exported EMA pipelines, metrics,
``train.log``). Then, for each stage, ``$OUT/<stage>.tar.gz`` (the work folder without the latents cache; without
the checkpoint too if the archive would pass ``MAX_ARCHIVE_MB``, the device tool's 16 MiB per returned file),
``$OUT/<stage>.log`` and ``$OUT/summary.json``, and prints a summary: steps reached, held-out verifier accuracy of
the last EMA evaluation, running loss, wall seconds, exit status. Run again with the same ``WORK_ROOT`` and every
stage continues from its last checkpoint (a stage that finished its steps is not started again, only summarised).

On the GPU machine (the device tool's ``run``; ``$OUT`` is its return folder, emptied before each call), which reaches
no package index: first, here, ``bash scripts/device_wheels.sh`` (the packages its image lacks, as wheels in
``.whl/``), then ``run`` with ``carry=[".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && TIME_LIMIT_S=$((540 - SECONDS)) \
        python3 scripts/device_pretrain.py

Settings (environment variables; defaults in brackets):

* ``DEVICE`` [cuda] — ``--device`` of the three runs (``cpu`` for the tests);
* ``OUT`` [runs/device_pretrain_out], ``WORK_ROOT`` [runs/device_pretrain] — returned files, work folders;
* ``TIME_LIMIT_S`` [480] — each process's ``timeout`` (seconds); ``STAGES`` [flow2 flux2 wan];
* ``FLOW2_STEPS`` [6000], ``FLUX2_STEPS`` [4000], ``WAN_VAE_STEPS`` [1000], ``WAN_STEPS`` [3000] — the runs'
  lengths (a checkpoint written with other lengths is refused: keep them across the calls of one run);
* ``NUM_LATENTS`` [30000], ``EDGE_WEIGHT`` [4] — flow2's and flux2's latents cache and ``--<stage>-edge-weight``
  (the issue 31 / 34 runs' settings; their model sizes are the scripts' defaults);
* ``EVALS`` [4] — EMA evaluations and exports per flow2/flux2 run (a run killed by its timeout keeps the last);
* ``THREADS`` [4] — CPU threads per process; ``TF32`` [0] — 1 passes ``--tf32``;
* ``FLOW2_ARGS``, ``FLUX2_ARGS``, ``WAN_ARGS`` [empty] — more options for each script (shell words).

Exit status: 0 when every stage finished its steps; 3 when one stopped early (its timeout; rerun to continue);
1 when one failed (its ``.log`` says why).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("flow2", "flux2", "wan")
# steps each run was estimated to reach in ~8 minutes on one H200 beside the other two; measured, flux2 alone made 1,800
# steps in 438 s (7.6 steps/s after 3 minutes of CPU set-up): docs/results/tiny_world.md
DEFAULT_STEPS = {"FLOW2_STEPS": 6000, "FLUX2_STEPS": 4000, "WAN_VAE_STEPS": 1000, "WAN_STEPS": 3000}


def setting(name: str, default: str) -> str:
    return os.environ.get(name, default)


def int_setting(name: str, default: int, minimum: int = 1) -> int:
    """The integer environment variable `name` (`default` when unset).

    Raises:
        SystemExit: one line naming the variable if it is no integer ≥ `minimum`."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is no integer; set it to a whole number >= {minimum} or unset it") from None
    if value < minimum:
        raise SystemExit(f"{name}={value}: must be >= {minimum}")
    return value


def stage_command(stage: str, work: Path, cfg: dict) -> list[str]:
    """The command line of `stage` ("flow2", "flux2", "wan") writing to `work`, resumable, on ``cfg["device"]``."""
    common = ["--device", cfg["device"], "--checkpoint-minutes", "1", "--resume", "--threads", str(cfg["threads"]),
              *(["--tf32"] if cfg["tf32"] else [])]
    if stage in ("flow2", "flux2"):
        steps = cfg[f"{stage}_steps"]
        return [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_world.py"), stage, "--work", str(work),
                "--out", str(ROOT / "diffalign" / "assets"), f"--{stage}-steps", str(steps),
                f"--{stage}-eval-every", str(max(1, steps // cfg["evals"])), "--num-latents", str(cfg["num_latents"]),
                f"--{stage}-edge-weight", setting("EDGE_WEIGHT", "4"), *common,
                *shlex.split(setting(f"{stage.upper()}_ARGS", ""))]
    wan_stage = "transformer" if (work / "wan_vae" / "config.json").exists() else "all"
    return [sys.executable, str(ROOT / "scripts" / "pretrain_tiny_video.py"), "--arch", "wan", "--wan-stage",
            wan_stage, "--work", str(work), "--wan-vae-steps", str(cfg["wan_vae_steps"]), "--steps",
            str(cfg["wan_steps"]), *common, *shlex.split(setting("WAN_ARGS", ""))]


def read_progress(stage: str, work: Path, target: int) -> dict:
    """What `stage`'s work folder says now: ``steps`` reached (the last checkpoint's step; for wan the transformer's,
    and ``vae_steps``), ``loss`` (the running loss at that checkpoint), ``heldout_accuracy`` (the last EMA evaluation:
    flow2/flux2 from the checkpoint's evaluations, wan from its finished export's metrics), ``finished`` (its
    metrics file says it trained `target` steps)."""
    import torch

    def ckpt(name: str) -> dict | None:
        path = work / name
        return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None

    res = {"steps": 0, "loss": None, "heldout_accuracy": None, "finished": False}
    if stage in ("flow2", "flux2"):
        c = ckpt(f"{stage}_checkpoint.pt")
        if c is not None:
            res.update(steps=c["step"], loss=c["running"])
            if c["evals"]:
                res["heldout_accuracy"] = c["evals"][-1]["heldout_accuracy"]
        metrics = work / f"{stage}_metrics.json"
        m = json.loads(metrics.read_text()) if metrics.exists() else {}
        if m.get("steps") == target:  # (a metrics file of a run of another length says nothing about this one)
            res.update(steps=m["steps"], loss=m["final_loss"], finished=True,
                       heldout_accuracy=m["heldout_accuracy_by_step"][-1]["heldout_accuracy"])
        return res
    v = ckpt("wan_vae_checkpoint.pt")
    res["vae_steps"] = v["step"] if v is not None else 0
    if (work / "wan_vae_metrics.json").exists():
        res["vae_steps"] = json.loads((work / "wan_vae_metrics.json").read_text())["steps"]
    c = ckpt("wan_checkpoint.pt")
    if c is not None:
        res.update(steps=c["step"], loss=c["running"])
    metrics = work / "tiny_wan_t2v" / "pretrain_metrics.json"
    m = json.loads(metrics.read_text()) if metrics.exists() else {}
    if m.get("steps") == target:
        res.update(steps=m["steps"], loss=m["final_running_loss"], heldout_accuracy=m["heldout"]["accuracy"],
                   finished=True)
    return res


def pack(work: Path, archive: Path, max_bytes: int) -> str:
    """`work` as `archive` (.tar.gz) without the latents caches and temporary files; without the checkpoints too if
    it would pass `max_bytes`. Returns what was left out ("" if only the caches)."""
    def add(skip_checkpoints: bool) -> None:
        with tarfile.open(archive, "w:gz") as tar:
            for f in sorted(work.rglob("*")):
                if f.is_file() and not f.name.endswith(("_latents.pt", ".tmp")) \
                        and not (skip_checkpoints and f.name.endswith("_checkpoint.pt")):
                    tar.add(f, arcname=str(f.relative_to(work)))

    add(skip_checkpoints=False)
    if archive.stat().st_size <= max_bytes:
        return ""
    add(skip_checkpoints=True)
    return f"checkpoints (archive over {max_bytes / 2**20:.0f} MiB; they stay in {work})"


def main() -> int:
    cfg = {"device": setting("DEVICE", "cuda"), "threads": int_setting("THREADS", 4),
           "tf32": setting("TF32", "0") == "1", "evals": int_setting("EVALS", 4),
           "num_latents": int_setting("NUM_LATENTS", 30_000),
           **{k.lower(): int_setting(k, v) for k, v in DEFAULT_STEPS.items()}}
    limit = int_setting("TIME_LIMIT_S", 480, minimum=30)
    stages = setting("STAGES", " ".join(STAGES)).split()
    if not stages or set(stages) - set(STAGES):
        raise SystemExit(f"STAGES={' '.join(stages)!r}: name some of {' '.join(STAGES)}")
    out, work_root = Path(setting("OUT", "runs/device_pretrain_out")), Path(setting("WORK_ROOT", "runs/device_pretrain"))
    max_bytes = int(float(setting("MAX_ARCHIVE_MB", "15.5")) * 2**20)
    sys.path.insert(0, str(ROOT / "scripts"))
    from pretrain_tiny_world import resolve_device

    resolve_device(cfg["device"])  # a bad DEVICE stops here, before any work
    out.mkdir(parents=True, exist_ok=True)
    targets = {s: cfg["wan_steps"] if s == "wan" else cfg[f"{s}_steps"] for s in stages}
    procs = {}
    for stage in stages:
        work = work_root / stage
        work.mkdir(parents=True, exist_ok=True)
        if read_progress(stage, work, targets[stage])["finished"]:
            print(f"[{time.strftime('%H:%M:%S')}] {stage}: finished in an earlier call, not started", flush=True)
            procs[stage] = (None, None, time.time())
            continue
        log = (work / "train.log").open("a")
        cmd = ["timeout", "--kill-after=20", str(limit), *stage_command(stage, work, cfg)]
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(cfg["threads"])}
        procs[stage] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env), log,
                        time.time())
        print(f"[{time.strftime('%H:%M:%S')}] started {stage}: {shlex.join(cmd)}", flush=True)
    summary = {}
    for stage, (proc, log, t0) in procs.items():
        rc = 0 if proc is None else proc.wait()
        if log is not None:
            log.close()
        work = work_root / stage
        row = {"rc": rc, "wall_s": round(time.time() - t0, 1), **read_progress(stage, work, targets[stage])}
        row["left_out"] = pack(work, out / f"{stage}.tar.gz", max_bytes)
        (out / f"{stage}.log").write_bytes((work / "train.log").read_bytes()[-max_bytes:])
        summary[stage] = row
    (out / "summary.json").write_text(json.dumps({"device": cfg["device"], "time_limit_s": limit,
                                                  "stages": summary}, indent=2))
    print(f"{'stage':<6} {'steps':>13} {'held-out':>9} {'loss':>8} {'wall s':>7} {'rc':>4}  note")
    for stage, r in summary.items():
        target = targets[stage]
        acc = "-" if r["heldout_accuracy"] is None else f"{r['heldout_accuracy']:.3f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        note = ("finished" if r["finished"] else "timed out: rerun to resume" if r["rc"] in (124, 137)
                else "failed: see its log" if r["rc"] else "stopped")
        if stage == "wan":
            note = f"vae {r['vae_steps']}/{cfg['wan_vae_steps']}; {note}"
        if r["left_out"]:
            note += f"; left out of the archive: {r['left_out']}"
        print(f"{stage:<6} {str(r['steps']) + '/' + str(target):>13} {acc:>9} {loss:>8} {r['wall_s']:>7} {r['rc']:>4}"
              f"  {note}")
    if any(r["rc"] not in (0, 124, 137) for r in summary.values()):
        return 1
    return 0 if all(r["finished"] for r in summary.values()) else 3


if __name__ == "__main__":
    sys.exit(main())
