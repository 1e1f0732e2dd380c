"""Mutation testing of one core module with mutmut (docs/contributing.md#mutation-testing): every small change mutmut
makes to the module (an operator, a constant, a comparison, a dropped argument ...) is run against that module's own
quick tests; a mutant no test notices ("survived") is a bug the suite would let through.

    python scripts/mutation.py --list                    # the modules and their tests
    python scripts/mutation.py advantages                # one module (single process)
    python scripts/mutation.py objectives/vipo --show    # ... and print the diff of every survivor
    python scripts/mutation.py advantages --keep         # reuse the last run's results (only changed code re-runs)
    python scripts/mutation.py objectives/vipo --only "*ViPOǁcompute_maps*"   # the mutants of some functions only

Each module runs in its own folder ``.mutation/<module>/`` (git-ignored), holding links to ``diffalign/``, ``tests/``
and ``pyproject.toml`` and a ``setup.cfg`` written here with the module (``only_mutate``) and its tests
(``pytest_add_cli_args_test_selection``); mutmut copies them into ``mutants/`` there and tests each mutant with the
mapped tests that execute the mutated function. The summary line (killed / survived / no tests / timeout) is printed
and written to ``.mutation/<module>/summary.json`` (mutmut's own output to ``mutmut.log`` there). One thread
(``OMP_NUM_THREADS=1``) and one worker (``--max-children 1``) unless ``--children`` says otherwise: the runs fit in
minutes on 2 cores. Do not edit ``diffalign/`` while a run starts: mutmut copies the sources then.

Exit status: 0 when every mutant was checked (whatever survived), 1 when mutmut failed (e.g. the clean tests fail).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".mutation"

# module (path under diffalign/, without .py) -> its quick tests (pytest arguments: files, node ids, -k)
MODULES: dict[str, list[str]] = {
    "advantages": ["tests/unit/test_advantages.py", "tests/unit/test_constant_rewards.py",
                   "tests/unit/test_advantages_by_hand.py"],
    "objectives/vipo": ["tests/unit/objectives/test_clip_binding.py", "tests/unit/objectives/test_vipo_wiring.py",
                        "tests/unit/objectives/test_vipo.py", "-k", "not online_loop and not recipes and not dinov2"],
    "objectives/policy_gradient": ["tests/unit/objectives/test_clip_binding.py",
                                   "tests/unit/objectives/test_policy_gradient_kl.py",
                                   "tests/unit/objectives/test_timestep_selection.py",
                                   "tests/unit/objectives/test_policy_gradient_plan.py",
                                   "tests/unit/objectives/test_policy_gradient_alarm.py", "-k", "not online and not loop"],
    "objectives/dgpo": ["tests/unit/objectives/test_dgpo_by_hand.py", "tests/unit/objectives/test_dgpo.py",
                        "tests/unit/objectives/test_dgpo_contract.py", "-k", "not online and not loop"],
    "objectives/diffusion_dpo": ["tests/unit/objectives/test_diffusion_dpo.py",
                                 "tests/unit/objectives/test_diffusion_dpo_contract.py", "-k",
                                 "not cli and not train"],
    "samplers/ddim_logprob": ["tests/unit/samplers/test_ddim_logprob.py", "tests/unit/samplers/test_ddim_sampler.py"],
    "samplers/flow_sde": ["tests/unit/samplers/test_flow_sampler.py", "tests/unit/samplers/test_flow_sde_step.py",
                          "-k", "not online and not loop"],
    "objectives/flow_grpo": ["tests/unit/objectives/test_clip_binding.py",
                             "tests/unit/objectives/test_policy_gradient_kl.py",
                             "tests/unit/objectives/test_timestep_selection.py",
                             "tests/unit/objectives/test_flow_grpo_config.py", "-k", "not online and not loop"],
    "objectives/common": ["tests/unit/objectives/test_common.py"],
    "objectives/ddpo": ["tests/unit/objectives/test_ddpo_config.py"],
    "reference/frozen_base": ["tests/unit/reference/test_reference.py",
                              "tests/unit/reference/test_ema_and_frozen_base.py", "-k",
                              "not train and not loop and not resume"],
    "reference/ema": ["tests/unit/reference/test_reference.py", "tests/unit/reference/test_ema_and_frozen_base.py",
                      "-k", "not train and not loop and not resume"],
    "reference/old_policy": ["tests/unit/objectives/test_dgpo.py", "tests/unit/reference/test_old_policy.py", "-k",
                             "not online and not loop"],
    "runtime/checkpoint": ["tests/unit/runtime/test_checkpoint.py", "tests/unit/runtime/test_checkpoint_contract.py",
                           "tests/unit/runtime/test_resume_rng.py"],
    "runtime/runlock": ["tests/unit/runtime/test_runlock_contract.py", "tests/integration/test_runlock.py", "-k",
                        ("not diffalign_train and not resume_latest and not keep_last and not diffalign_eval and not "
                         "a_run_inside")],
    "samplers/cps": ["tests/unit/samplers/test_samplers.py", "tests/unit/samplers/test_cps_window_contract.py", "-k",
                     "not trains and not command_line"],
    "samplers/window_sde": ["tests/unit/samplers/test_samplers.py", "tests/unit/samplers/test_cps_window_contract.py",
                            "-k", "not trains and not command_line"],
    "objectives/grpo_guard": ["tests/unit/objectives/test_grpo_guard.py",
                              "tests/unit/objectives/test_grpo_guard_contract.py", "-k", "not trains"],
    "objectives/diffusion_nft": ["tests/unit/objectives/test_diffusion_nft.py",
                                 "tests/unit/objectives/test_diffusion_nft_contract.py", "-k",
                                 "not resume and not command_line"],
    "objectives/seppo": ["tests/unit/objectives/test_seppo.py", "tests/unit/objectives/test_seppo_contract.py", "-k",
                         "not resume and not cli"],
    "objectives/ddspo": ["tests/unit/objectives/test_ddspo.py", "tests/unit/objectives/test_ddspo_contract.py", "-k",
                         "not command"],
}


def module_path(module: str) -> Path:
    """``diffalign/<module>.py``, whichever layout the package has (a module may have moved into a sub-package)."""
    path = REPO / "diffalign" / f"{module}.py"
    if not path.is_file():
        raise SystemExit(f"diffalign/{module}.py does not exist; pick one of: {', '.join(MODULES)} (--list)")
    return path


def prepare(module: str, keep: bool, only: list[str] = ()) -> Path:
    """The module's mutmut folder with its config (emptied first unless `keep`).

    With `keep` and `only`, mutmut's record of which tests run each function (``mutants/mutmut-stats.json``) is
    deleted, so that the named mutants run against the tests as they are now: mutmut re-collects it only for tests
    with new names, so a mutant re-run after a test was extended would meet the old selection and "survive" again."""
    folder = WORK / module.replace("/", ".")
    if folder.exists() and not keep:
        shutil.rmtree(folder)
    stats = folder / "mutants" / "mutmut-stats.json"
    if keep and only and stats.exists():
        stats.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("diffalign", "tests", "pyproject.toml"):
        link = folder / name
        if not link.exists():
            link.symlink_to(REPO / name)
    tests = MODULES[module]
    config = ["[mutmut]", "source_paths = diffalign", f"only_mutate = diffalign/{module}.py",
              "pytest_add_cli_args_test_selection =", *[f"    {arg}" for arg in tests],
              "pytest_add_cli_args =", "    -p", "    no:xdist", "    -p", "    no:cacheprovider",
              "process_isolation = fork", ""]
    (folder / "setup.cfg").write_text("\n".join(config))
    return folder


def summarise(folder: Path, module: str, only: list[str]) -> dict:
    """Counts of each mutant status (of the mutants matching `only`, when given), read from mutmut's ``.meta`` file of
    the module."""
    from fnmatch import fnmatch

    from mutmut.stats import status_by_exit_code

    meta = folder / "mutants" / "diffalign" / f"{module}.py.meta"
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    if only:
        codes = {name: code for name, code in codes.items() if any(fnmatch(name, p) for p in only)}
    statuses = {name: status_by_exit_code[code] for name, code in codes.items()}
    counts = Counter(statuses.values())
    return {"module": f"diffalign/{module}.py", "mutants": len(statuses), "counts": dict(counts),
            "survived": sorted(n for n, s in statuses.items() if s != "killed")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("module", nargs="?", help="a module under diffalign/, e.g. advantages or objectives/vipo")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests")
    parser.add_argument("--keep", action="store_true", help="keep the previous run's results for unchanged code")
    parser.add_argument("--show", action="store_true", help="print the diff of every mutant that was not killed")
    parser.add_argument("--children", type=int, default=1, help="mutmut worker processes (default 1)")
    parser.add_argument("--only", nargs="+", default=[], metavar="PATTERN",
                        help="mutant names or globs (mutmut's, e.g. '*ViPOǁ__call__*'): run those only")
    args = parser.parse_args()
    if args.list or not args.module:
        for module, tests in MODULES.items():
            print(f"{module:30s} {' '.join(tests)}")
        return
    if args.module not in MODULES:
        raise SystemExit(f"no test mapping for {args.module!r}; add it to MODULES in scripts/mutation.py (--list)")
    module_path(args.module)
    folder = prepare(args.module, args.keep, args.only)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the mutated copy in mutants/ must be the diffalign that imports
    mutmut = [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; sys.exit(cli())"]
    log = folder / "mutmut.log"  # (mutmut redraws a progress line per mutant: kept out of the terminal)
    print(f"[mutation] diffalign/{args.module}.py with {' '.join(MODULES[args.module])}; mutmut's output: {log}")
    with log.open("w") as out:
        run = subprocess.run([*mutmut, "run", "--max-children", str(args.children), *args.only], cwd=folder, env=env,
                             stdout=out, stderr=subprocess.STDOUT, check=False)
    if run.returncode != 0:
        raise SystemExit(f"mutmut failed (exit {run.returncode}); its output ends:\n" + log.read_text()[-3000:])
    summary = summarise(folder, args.module, args.only)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    killed = summary["counts"].get("killed", 0)
    others = ", ".join(f"{n} {s}" for s, n in sorted(summary["counts"].items()) if s != "killed")
    print(f"\n{summary['module']}: {summary['mutants']} mutants, {killed} killed" + (f"; {others}" if others else ""))
    if args.show:
        for name in summary["survived"]:
            subprocess.run([*mutmut, "show", name], cwd=folder, env=env, check=False)


if __name__ == "__main__":
    main()
