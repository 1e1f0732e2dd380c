"""Command-line entry points ``diffalign-train`` and ``diffalign-eval`` (Hydra).

The configs ship inside the package (``diffalign/configs``; the repository's top-level ``configs/`` and ``recipes/``
point there), so both commands work from a clone and from an installed wheel. Config-group options come from the
YAML files and, for plugins, from Python entry points registered into Hydra's ConfigStore before Hydra starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from diffalign.config.checks import check_renamed_keys
from diffalign.config.compose import CONFIG_DIR, setup_hydra
from diffalign.runtime.console import quiet_on_broken_pipe
from diffalign.runtime.openmp import shared_machine_defaults


def check_reward_overrides(argv: list[str]) -> None:
    """Rejects unknown names in ``reward=...`` / ``eval_reward=...`` command-line overrides before Hydra composes
    anything (Hydra alone says only "Could not load 'reward/<name>'" for entry-point options), and registers one-off
    ``python:<module>:<function>`` rewards found there (importing them, so a bad one fails here).

    Raises:
        ValueError: naming the unknown reward(s) and listing the installed ones.
        ImportError: a ``python:`` reward cannot be imported.
    """
    from diffalign.config.registry import REWARD_GROUPS, reward_names
    from diffalign.rewards.python_function import PREFIX, load_function, register_python_reward

    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key.lstrip("+~") not in REWARD_GROUPS:
            continue
        names = [n.strip() for n in value.strip().strip("[]").split(",") if n.strip()]
        known = reward_names()
        for name in names:
            if name.startswith(PREFIX):
                load_function(name)
                register_python_reward(name)
        unknown = [n for n in names if n not in known and not n.startswith(PREFIX)]
        if unknown:
            raise ValueError(f"{key.lstrip('+~')}={value}: unknown reward(s) {unknown}; the rewards "
                             f"(diffalign's and the entry-point group diffalign.rewards'): {known}. Select e.g. "
                             f"reward=[{known[0]}], or a one-off function with reward=[python:<module>:<function>]")


def check_composition(config_name: str, argv: list[str]) -> None:
    """Composes the config once before ``hydra.main`` does, only to turn a composition error Hydra would report in
    several lines with wrong advice (``trainer.max_step=2``: "To append to your config use +trainer.max_step=2") into
    one line naming the key or option, the closest real ones and the fix (`diffalign.config.composition`). Left to
    Hydra: a config that composes, an error it cannot name, ``HYDRA_FULL_ERROR=1``, ``--help``, ``-m``
    (`diffalign.config.composition.run_overrides`).

    Raises:
        ConfigError: the one line (a `ValueError`).
    """
    from diffalign.config.checks import ConfigError
    from diffalign.config.composition import composition_error, run_overrides

    overrides = run_overrides(argv)
    if overrides is None:
        return
    message = composition_error(config_name, overrides)
    if message is not None:
        raise ConfigError(message)


def _command_line_overrides() -> list[str]:
    """The command line's ``key=value`` overrides (Hydra's task overrides); empty outside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # (HydraConfig not set: called from Python)
        return []


def _adopt_job_folder(cfg: DictConfig) -> None:
    """Under ``-m`` (a Hydra sweep: ``diffalign-train -m seed=0,1,2``) the job's ``output_dir`` becomes its own folder,
    ``<output_dir>/<job number>`` (`diffalign.runtime.runlock.job_output_dir`): every job of a sweep got the sweep's
    ``output_dir``, so the second one found the first's checkpoints and was refused."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and hydra_cfg.runtime.output_dir:
        with open_dict(cfg):
            cfg.output_dir = hydra_cfg.runtime.output_dir


def _train_main(cfg: DictConfig) -> None:
    from diffalign.lora.initial import command_line_model_keys
    from diffalign.train.prepare import build_run, check_run, is_online

    _adopt_job_folder(cfg)
    overrides = _command_line_overrides()
    try:
        # every check once, before any model loads (model.init_lora adopted; diffalign/train/prepare.py)
        check_run(cfg, overrides, explicit_model_keys=command_line_model_keys())
        online = is_online(cfg)
    except (ValueError, FileNotFoundError) as err:
        _refuse(err)
    if online:
        from diffalign.train.online import train as run
    else:
        from diffalign.train.preference import train as run
    from diffalign.config.checks import ConfigError
    from diffalign.rewards.base import RewardError
    from diffalign.runtime.faults import NonFiniteError, RolloutMismatchError, TrainingInterrupted, resume_hint
    from diffalign.runtime.runlock import RunLockedError
    from diffalign.runtime.storage import DiskFullError

    try:
        try:
            prepared = build_run(cfg)  # every component once (the run lock: taken by the Hydra callback)
        except ConfigError as err:  # a constructor's argument check (diffalign.config.validation.construct)
            _refuse(err)
        run(prepared)
    except RunLockedError as err:  # (the Hydra callback refuses first; this covers hydra.callbacks overridden away)
        raise SystemExit(f"diffalign: error: {err}") from None
    except TrainingInterrupted as err:  # SIGTERM / SIGINT: checkpoint saved; exit 143 / 130 like an untrapped signal
        _close_progress_bars()
        print(f"diffalign: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    except (NonFiniteError, RolloutMismatchError, RewardError) as err:  # (a checkpoint was saved; the message names it)
        _exit_with_error(err)
    except DiskFullError as err:  # the folder, what was written and the space; nothing partial kept (runtime/storage.py)
        err.hint = resume_hint(cfg.output_dir)
        _exit_with_error(err)


def _refuse(err: BaseException) -> NoReturn:
    """Exits with status 1 and ``diffalign: error: <err>`` for a run refused by a check that runs after Hydra made the
    output folder: the folder is left as it was (removed when this run created it; Hydra's files put back when it
    existed: `diffalign.runtime.runlock.undo_run_start`)."""
    from diffalign.runtime.runlock import undo_run_start

    undo_run_start()
    raise SystemExit(f"diffalign: error: {err}") from None


def _close_progress_bars() -> None:
    """Closes the progress bars still open (the run stopped inside them; a bar left open would be drawn once more when
    the interpreter exits, after the exit line), so that the line written next is the last one on the terminal and
    starts on a line of its own."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()


def _exit_with_error(err: BaseException) -> NoReturn:
    """Exits with status 1 and ``diffalign: error: <err>`` as the last line on the terminal: the progress bars still
    open (the run stopped inside them) are closed first."""
    _close_progress_bars()
    raise SystemExit(f"diffalign: error: {err}") from None


def _adopt_saved_lora_settings(cfg: DictConfig, folders: list) -> None:
    """Builds the evaluated policy's adapter as the checkpoints were trained (rank, alpha, target modules, from the
    LoRA file's metadata), so that a run whose recipe changed them (e.g. ``recipe=tiny_dpo`` adds the ResNet
    convolutions) evaluates without repeating its model overrides. Settings the model's constructor does not take
    are left alone.

    Raises:
        ValueError: if the checkpoints were trained with different adapter settings (evaluate them separately), a
            LoRA file cannot be read or is malformed (`diffalign.lora.io.read_lora`), or a LoRA is for the other kind
            of denoiser (`init_lora.check_lora_family`) or another model size (`init_lora.check_lora_fits`).
    """
    import inspect

    from hydra.utils import get_method

    from diffalign.lora.initial import check_lora_family, check_lora_fits
    from diffalign.lora.io import read_lora
    from diffalign.models.base import saved_lora_settings

    for folder in folders:  # an SD3 run's LoRA evaluated on the default SD model (or the reverse), a malformed LoRA or
        # one of another model size: named before loading (not after the base model was sampled)
        weights = read_lora(folder, field_name="checkpoint")
        check_lora_family(cfg, weights, field="checkpoint")
        check_lora_fits(cfg, weights, field="checkpoint")
    found = {str(f): saved_lora_settings(f) for f in folders}
    distinct = {json.dumps(v, sort_keys=True) for v in found.values() if v}
    if len(distinct) > 1:
        raise ValueError(f"the checkpoints were trained with different LoRA settings ({found}); evaluate them in "
                         "separate diffalign-eval runs")
    if not distinct:
        return
    settings = json.loads(distinct.pop())
    params = inspect.signature(get_method(cfg.model._target_)).parameters
    adopted = {key: value for key, value in settings.items() if key in params}
    if adopted:
        print(f"[diffalign] LoRA settings from the checkpoints: {adopted}")
    with open_dict(cfg):
        for key, value in adopted.items():
            cfg.model[key] = value


def _adopt_run_model(cfg: DictConfig, folders: list, overrides: list[str]) -> None:
    """Evaluates checkpoints on the model their run trained: when the command line does not choose a model (no
    ``model=...``), the ``model`` node of the runs' saved config (``<run>/.hydra/config.yaml``, in the folder above
    each checkpoint folder) replaces the evaluation's default one (the tiny SD model), so that
    ``diffalign-eval checkpoints=[base,<an SD3 run>/final]`` needs no ``model=tiny_sd3``. ``model.<key>=...`` overrides
    on the command line are applied on top of it; the run's ``init_lora`` is dropped (a checkpoint holds the whole
    adapter). Checkpoints without a saved config (a LoRA folder copied elsewhere) keep the command line's model.

    Raises:
        ValueError: if the checkpoints' runs trained different models (naming the checkpoints and their models).
    """
    from diffalign.lora.initial import model_config

    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    if "model" in keys:
        return
    found = {}
    for folder in folders:
        saved = Path(folder).resolve().parent / ".hydra" / "config.yaml"
        if saved.is_file():
            run_cfg = OmegaConf.load(saved)
            if run_cfg.get("model") is not None:
                found[str(folder)] = (saved, OmegaConf.to_container(model_config(run_cfg.model)))
    if not found:
        return
    if len({json.dumps(m, sort_keys=True) for _, m in found.values()}) > 1:
        named = "; ".join(f"{k}: {m.get('_target_')} ({m.get('pretrained_model_name_or_path')})"
                          for k, (_, m) in found.items())
        raise ValueError(f"the checkpoints come from runs that trained different models ({named}); evaluate them in "
                         "separate diffalign-eval runs")
    saved, model = next(iter(found.values()))
    current = OmegaConf.to_container(cfg.model, resolve=True)
    for key in keys:  # the command line's model.<key>=... (and ~model.<key>) still apply
        name = key[len("model."):] if key.startswith("model.") else None
        if name and "." not in name:
            if name in current:
                model[name] = current[name]
            else:
                model.pop(name, None)
    if model == OmegaConf.to_container(model_config(cfg.model)):
        return
    print(f"[diffalign] model from the run's config ({saved}): {model.get('_target_')} "
          f"({model.get('pretrained_model_name_or_path')}); pass model=... to override")
    with open_dict(cfg):
        cfg.model = OmegaConf.create(model)


def _eval_main(cfg: DictConfig) -> None:
    from diffalign.config.checks import boolean, check_structured_keys, check_top_level_keys
    from diffalign.config.validation import (
        check_output_dir,
        check_reward_nodes,
        train_config_keys,
        validate_eval_config,
        validate_reward_modality,
    )
    from diffalign.evaluation.files import LORA_FILE, check_checkpoint_exists, resolve_checkpoints

    _adopt_job_folder(cfg)
    try:
        check_top_level_keys(cfg, train_config_keys("evaluate"), "evaluate.yaml")  # +output=..., +checkpont=...
        check_structured_keys(cfg)  # a key added with + that no structured node has
        check_output_dir(cfg.output_dir)
        for key in ("include_base", "report", "resume"):
            boolean(cfg, key, "")
        validate_eval_config(cfg)
        check_reward_nodes(cfg)
        validate_reward_modality(cfg)
        if cfg.checkpoints is not None and cfg.checkpoint is not None:
            raise ValueError("pass checkpoints=[...] or checkpoint=<folder>, not both (checkpoints=[base,<folder>] "
                             "is the same as checkpoint=<folder>)")
        if cfg.checkpoints is not None:
            variants = resolve_checkpoints(list(cfg.checkpoints))
        else:
            if cfg.checkpoint is not None:
                check_checkpoint_exists("checkpoint", str(cfg.checkpoint))
            if cfg.checkpoint is not None and not (Path(cfg.checkpoint) / LORA_FILE).is_file():
                raise FileNotFoundError(f"checkpoint={str(cfg.checkpoint)!r} holds no {LORA_FILE}; pass a "
                                        "checkpoint-<step>/ or final/ folder of a diffalign-train run (a run folder "
                                        "goes in checkpoints=[base,<run folder>]: every checkpoint of it)")
            if cfg.checkpoint is None and not cfg.include_base:
                raise ValueError("nothing to evaluate: pass checkpoint=<folder>, checkpoints=[...] or include_base=true")
            variants = {"base": True} if cfg.include_base else {}
            if cfg.checkpoint is not None:
                variants["checkpoint"] = Path(cfg.checkpoint)
        if cfg.run_dir is not None and not Path(cfg.run_dir).is_dir():
            raise FileNotFoundError(f"run_dir={cfg.run_dir!r} is not a folder; pass a diffalign-train output_dir")
        folders = [v for v in variants.values() if not isinstance(v, bool)]
        _adopt_run_model(cfg, folders, _command_line_overrides())
        _adopt_saved_lora_settings(cfg, folders)
    except (ValueError, FileNotFoundError) as err:
        _refuse(err)

    from diffalign.rewards.base import RewardError
    from diffalign.runtime.faults import StopSignals, TrainingInterrupted
    from diffalign.runtime.storage import DiskFullError

    # SIGTERM / SIGINT: the evaluation stops before its next batch (what is finished is kept; a rerun continues it)
    with StopSignals(hint="run the same command again to continue") as stop:
        try:
            _evaluate(cfg, variants)
            stop.raise_if_received("at the end", f"the evaluation finished; its results are in {cfg.output_dir}")
        except TrainingInterrupted as err:
            _close_progress_bars()
            print(f"diffalign: {err}", file=sys.stderr)
            raise SystemExit(err.exit_code) from None
        except RewardError as err:  # one line naming the reward, batch and prompt (finished batches are kept)
            _exit_with_error(err)
        except DiskFullError as err:  # one line: the file, the folder, the free space (finished prompts are kept)
            err.hint = "run the same command again to continue"
            _exit_with_error(err)


def _evaluate(cfg: DictConfig, variants: dict) -> None:
    from hydra.utils import instantiate

    from diffalign.evaluation.evaluate import evaluate_policy
    from diffalign.evaluation.files import base_reuse_key
    from diffalign.evaluation.generation import eval_config_from, select_prompts
    from diffalign.evaluation.metrics import comparison_lines
    from diffalign.evaluation.report import write_report
    from diffalign.rewards.reward_set import build_checked_rewards
    from diffalign.world.prompts import load_prompts

    rewards = build_checked_rewards(cfg.reward)  # build → guard, as the training loops' evaluation
    ecfg = eval_config_from(cfg.eval)
    rows = select_prompts(load_prompts(ecfg.prompts, field="eval.prompts"), ecfg.prompts_per_tag)
    policy = instantiate(cfg.model)
    output_dir = Path(cfg.output_dir)
    metrics = evaluate_policy(policy, rows, rewards, ecfg, output_dir, variants, resume=cfg.resume,
                              context={"model": OmegaConf.to_container(cfg.model, resolve=True)},
                              base_key=base_reuse_key(cfg.model, cfg.reward))
    for line in comparison_lines(metrics):  # (each variant's own figures were logged as it finished)
        print(f"[diffalign] {line}")
    print(f"[diffalign] eval written to {output_dir} (metrics.json, metrics.csv: every figure)")
    if cfg.report:
        run_dirs = {Path(v).resolve().parent for v in variants.values() if not isinstance(v, bool)}
        run_dir = cfg.run_dir if cfg.run_dir is not None else (run_dirs.pop() if len(run_dirs) == 1 else None)
        print(f"[diffalign] report: {write_report(output_dir, run_dir=run_dir)}")


def _say_interrupted() -> None:
    _close_progress_bars()
    print("diffalign: interrupted", file=sys.stderr)


def _run_hydra(config_name: str, task) -> None:
    """Runs `task` under Hydra with ``config_name``. A run that stops before it wrote anything of its own (Ctrl-C
    before it started, an error Hydra reports) leaves no output folder behind; Ctrl-C ends with one line, exit 130."""
    from diffalign.runtime.runlock import forget_run_start, undo_run_start

    try:
        hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name=config_name)(task)()
    except KeyboardInterrupt:  # Ctrl-C before the run started, or a second one (the first stops at a safe point)
        undo_run_start(existing=False)
        _say_interrupted()
        sys.exit(130)
    except SystemExit as ended:
        if ended.code not in (None, 0):
            undo_run_start(existing=False)
        raise
    finally:  # (the run has ended: a later run from this process must not undo this one's folders)
        forget_run_start()


@quiet_on_broken_pipe
def train() -> None:
    """``diffalign-train``: fine-tune with a preference objective, then evaluate base vs fine-tuned."""
    shared_machine_defaults()  # before torch loads: OMP_WAIT_POLICY=PASSIVE beside busy CPUs (runtime/openmp.py)
    setup_hydra()
    try:
        check_renamed_keys(sys.argv[1:])
        check_reward_overrides(sys.argv[1:])
        check_composition("train", sys.argv[1:])
    except (ValueError, ImportError) as err:
        sys.exit(f"diffalign: error: {err}")
    _run_hydra("train", _train_main)


@quiet_on_broken_pipe
def evaluate() -> None:
    """``diffalign-eval``: evaluate the base model and checkpoints on a prompt set; write metrics and a report."""
    shared_machine_defaults()  # before torch loads (runtime/openmp.py)
    setup_hydra()
    try:
        check_renamed_keys(sys.argv[1:])
        check_reward_overrides(sys.argv[1:])
        check_composition("evaluate", sys.argv[1:])
    except (ValueError, ImportError) as err:
        sys.exit(f"diffalign: error: {err}")
    _run_hydra("evaluate", _eval_main)


if __name__ == "__main__":  # `python -m diffalign.cli <overrides>`, and `accelerate launch ... -m diffalign.cli <overrides>`
    sys.argv[0] = "diffalign-train"
    train()
