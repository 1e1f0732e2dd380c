"""Seconds from ``diffalign-train <args>`` to its error line (or ``--help``'s end), for two checkouts run alternately.

Each case runs `--repeats` times per checkout, the checkouts alternating (before, after, before, ...), so both see the
same load; it prints every run and then the medians of the wall and the CPU seconds (user + system of the child).
The CPU seconds are the steadier figure on a shared machine, where the wall time follows the other processes. Each
run is ``python -m diffalign.cli`` in a fresh process with ``PYTHONPATH`` set to the checkout (one OpenMP thread,
offline hub), so each imports its own ``diffalign``. docs/results/performance.md#start-up gives the figures.

    python scripts/startup_time.py --before /path/to/old/checkout --after . --repeats 5

Exits with status 1 if a case does not end as expected (no ``diffalign: error`` line, or ``--help`` failing).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "config error": ["trainer.batch_size=-1"],
    "composition error": ["trainer.max_step=2"],
    "--help": ["--help"],
}
"""Case → ``diffalign-train`` arguments: a field check's error (after composing), a composition error (before
``hydra.main``), and the help text (discovery and composition only)."""


def run_once(checkout: Path, args: list[str], output_dir: str) -> tuple[float, float, bool]:
    """``(wall seconds, CPU seconds, ended as expected)`` of one ``diffalign-train`` run from `checkout`."""
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "diffalign.cli", *args]
    if args != ["--help"]:
        command.append(f"output_dir={output_dir}")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    ok = done.returncode == 0 if args == ["--help"] else "diffalign: error" in done.stderr
    return wall, cpu, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the old checkout (a git worktree)")
    parser.add_argument("--after", type=Path, required=True, help="the new checkout")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case and checkout (default 5)")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES), help="which cases")
    parser.add_argument("--output-dir", default="/tmp/startup_time_run", help="output_dir of the refused runs")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    for label, path in checkouts.items():
        if not (path / "diffalign" / "cli.py").is_file():
            parser.error(f"--{label}={path} is not a diffalign checkout (no diffalign/cli.py); pass the repository root")
    runs: dict[tuple[str, str], list[tuple[float, float, bool]]] = {}
    for case in args.cases:
        for repeat in range(args.repeats):
            for label, path in checkouts.items():
                wall, cpu, ok = run_once(path, CASES[case], args.output_dir)
                runs.setdefault((case, label), []).append((wall, cpu, ok))
                print(f"{case:18s} {label:6s} #{repeat}: wall {wall:6.2f} s, CPU {cpu:6.2f} s, as expected: {ok}",
                      flush=True)
    print(f"\nmedians of {args.repeats} (before = {checkouts['before']}, after = {checkouts['after']})")
    for case in args.cases:
        walls = {label: statistics.median(w for w, _, _ in runs[(case, label)]) for label in checkouts}
        cpus = {label: statistics.median(c for _, c, _ in runs[(case, label)]) for label in checkouts}
        print(f"{case:18s} wall {walls['before']:6.2f} -> {walls['after']:6.2f} s ({walls['after'] / walls['before']:.2f}x)"
              f"  CPU {cpus['before']:6.2f} -> {cpus['after']:6.2f} s ({cpus['after'] / cpus['before']:.2f}x)")
    if not all(ok for rows in runs.values() for _, _, ok in rows):
        sys.exit("startup_time: a run did not end as expected (see the lines above)")


if __name__ == "__main__":
    main()
