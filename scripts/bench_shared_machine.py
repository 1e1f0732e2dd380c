"""The main job and one online epoch on an idle machine and beside one competing CPU-bound process, under each
candidate OpenMP default, in one run: which default bounds the slowdown on a shared machine without costing the idle
case (issue 33, item 4; docs/guides/performance.md#shared-machines).

    python scripts/bench_shared_machine.py                         # every candidate, both workloads, 1 repeat
    python scripts/bench_shared_machine.py --workloads online --repeats 2
    python scripts/bench_shared_machine.py --quick                 # tiny sizes: a test of the tool (timings mean nothing)

Workloads (each run is a fresh ``diffalign-train`` process, ``python -m diffalign.cli``; its wall time is process
start to exit, and the phases come from its ``results.json``):

- ``main``: the README's main job **shortened** (on-policy data for 256 of the 594 train prompts, 20 training steps,
  no evaluation): a minute's job instead of several, with the same phases (batched no-grad sampling, then forward +
  backward steps); what counts is the ratio contended / idle, not the seconds;
- ``online``: one epoch of ``recipe=tiny_flow_grpo`` (8 prompts x 8 samples, 10 SDE steps, one update), no
  evaluation, checkpoints or trackers.

Candidates (the job's environment; every other OpenMP variable removed):

- ``default``: today's behaviour before the start-up choice, libgomp's own default made explicit
  (``GOMP_SPINCOUNT=300000``, the value libgomp uses when ``OMP_WAIT_POLICY`` is unset), which also keeps the
  start-up choice out (a user's ``GOMP_SPINCOUNT`` wins);
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` always;
- ``threads-1``: ``OMP_NUM_THREADS=1`` always;
- ``adaptive``: no variable set: diffalign's start-up choice (`diffalign.runtime.openmp.shared_machine_defaults`),
  which sets ``OMP_WAIT_POLICY=PASSIVE`` when other processes keep the CPUs busy; each run records what it chose.

The competitor is a separate Python process multiplying 1024 x 1024 float32 matrices with torch in a loop, with
torch's default threads and no OpenMP variable (a typical other job, started before the measured one and stopped after
it). For each workload and repeat the candidates run in turn, each idle and then beside the competitor, so slow drift
of the machine touches all of them alike. A contended run longer than ``--cap`` times the idle ``default`` run of the
same workload is stopped and printed as "> cap" (a lower bound).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND",
            "OMP_DYNAMIC", "KMP_BLOCKTIME")
CANDIDATES = {
    "default": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "threads-1": {"OMP_NUM_THREADS": "1"},
    "adaptive": {},
}
COMMON = ["trainer.log_with=none", "eval.enabled=false", "monitor.every=0"]
WORKLOADS = {
    "main": ["trainer.max_steps=20", "data.num_prompts=256"],
    "online": ["recipe=tiny_flow_grpo", "online.num_epochs=1", "online.checkpointing_epochs=null"],
}
QUICK = {
    "main": ["trainer.max_steps=2", "data.num_prompts=16", "data.batch_size=16", "trainer.batch_size=4"],
    "online": ["recipe=tiny_flow_grpo", "online.num_epochs=1", "online.checkpointing_epochs=null",
               "online.groups_per_epoch=2", "online.group_size=4", "online.rollout_batch_size=8",
               "trainer.batch_size=8", "sampler.num_inference_steps=4"],
}
COMPETITOR = """
import sys, torch
a = torch.randn(1024, 1024)
b = torch.randn(1024, 1024)
torch.mm(a, b)
print("ready", torch.get_num_threads(), flush=True)
while True:
    torch.mm(a, b)
"""


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    env.update(PYTHONPATH=str(REPO), TQDM_DISABLE="1", HF_HUB_OFFLINE="1", **extra)
    return env


class Competitor:
    """The competing process: started and running its loop on enter, killed on exit."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=clean_env({}), stdout=subprocess.PIPE,
                                     text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            raise SystemExit(f"bench_shared_machine: the competing process did not start ({line!r})")
        time.sleep(1.0)  # (its loop runs; the start-up probe of the measured job sees it)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def run_job(overrides: list[str], env_extra: dict[str, str], out: Path, cap: float | None) -> dict:
    """One ``diffalign-train`` process: wall seconds, CPU seconds, the phases from ``results.json``, and whether the
    start-up choice set ``OMP_WAIT_POLICY=PASSIVE``; ``capped`` when it was stopped at `cap` seconds."""
    cmd = [sys.executable, "-m", "diffalign.cli", f"output_dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=clean_env(env_extra), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = None
    capped = threading.Event()
    if cap is not None:
        def stop():
            capped.set()
            os.killpg(proc.pid, signal.SIGKILL)
        timer = threading.Timer(cap, stop)
        timer.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if timer is not None:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    info = {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "capped": capped.is_set(),
            "adapted": "OMP_WAIT_POLICY=PASSIVE" in output}
    if capped.is_set():
        return info
    if proc.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise SystemExit(f"bench_shared_machine: {' '.join(cmd[3:])} failed ({proc.returncode}): {tail}")
    res = json.loads((out / "results.json").read_text())
    info["phases"] = {k: res[k] for k in ("data_seconds", "train_seconds", "total_seconds") if k in res}
    return info


def ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}x" if b > 0 else "   - "


def report(results: dict, cap: float) -> None:
    for workload, by_cand in results.items():
        base = statistics.median(r["wall"] for r in by_cand["default"]["idle"])
        print(f"\n{workload}: wall seconds, median of {len(by_cand['default']['idle'])} (idle | beside the competitor); "
              f"contended / idle; idle / default's idle")
        print(f"  {'candidate':<10} {'idle':>8} {'contended':>10} {'slowdown':>9} {'idle cost':>10}   cpu s idle / "
              "contended; start-up choice idle / contended")
        for cand, runs in by_cand.items():
            idle = statistics.median(r["wall"] for r in runs["idle"])
            busy_runs = runs["contended"]
            busy = statistics.median(r["wall"] for r in busy_runs)
            capped = any(r["capped"] for r in busy_runs)
            slow = (">" if capped else " ") + ratio(busy, idle)
            cpu = (f"{statistics.median(r['cpu'] for r in runs['idle']):.0f} / "
                   f"{statistics.median(r['cpu'] for r in busy_runs):.0f}")
            choice = ""
            if cand == "adaptive":
                def said(rs):
                    return "/".join("PASSIVE" if r["adapted"] else "none" for r in rs)
                choice = f"; {said(runs['idle'])} | {said(busy_runs)}"
            spread = ", ".join(f"{r['wall']:.1f}" for r in busy_runs)
            idles = ", ".join(f"{r['wall']:.1f}" for r in runs["idle"])
            print(f"  {cand:<10} {idle:7.1f}s {busy:9.1f}s{'+' if capped else ' '} {slow:>8} {ratio(idle, base):>10}"
                  f"   {cpu}{choice}   (contended runs: {spread}; idle: {idles})")
    print(f"\n(a '+' / '>': stopped at --cap {cap:g} x the idle default run: a lower bound)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--repeats", type=int, default=1, help="rounds over the candidates per workload")
    p.add_argument("--cap", type=float, default=5.0, help="stop a contended run after this multiple of idle default")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a test of the tool; timings mean nothing)")
    p.add_argument("--json", type=Path, default=None, help="write every run here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.cap <= 1:
        p.error("--repeats must be >= 1 and --cap > 1")
    candidates = ["default"] + [c for c in args.candidates if c != "default"]  # (default first: the cap's base)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; candidates {candidates}")
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        n = 0
        for workload in args.workloads:
            overrides = COMMON + (QUICK if args.quick else WORKLOADS)[workload]
            by_cand = results.setdefault(workload, {})
            for _ in range(args.repeats):
                for cand in candidates:
                    runs = by_cand.setdefault(cand, {"idle": [], "contended": []})
                    n += 1
                    runs["idle"].append(run_job(overrides, CANDIDATES[cand], Path(tmp) / f"run{n}", None))
                    base = min(r["wall"] for r in by_cand["default"]["idle"])
                    n += 1
                    with Competitor():
                        runs["contended"].append(run_job(overrides, CANDIDATES[cand], Path(tmp) / f"run{n}",
                                                         args.cap * base))
                    print(f"  {workload} {cand}: idle {runs['idle'][-1]['wall']:.1f} s, beside the competitor "
                          f"{runs['contended'][-1]['wall']:.1f} s{' (capped)' if runs['contended'][-1]['capped'] else ''}",
                          flush=True)
                    if args.json:
                        args.json.write_text(json.dumps(results, indent=1))
    report(results, args.cap)
    return 0


if __name__ == "__main__":
    sys.exit(main())
