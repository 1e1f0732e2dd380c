"""Shared pytest fixtures and helpers: tiny real diffusers components built in-process (no network, no hub files), the
config helpers that compose ``diffalign-train`` configs, and small data helpers. Test modules import the helpers with
``from conftest import ...``."""

from __future__ import annotations

import contextlib
import io
import math
import os
from pathlib import Path

# No test may reach the network: huggingface_hub / transformers / open_clip read only the local cache (set before
# huggingface_hub is first imported, which reads it once).
os.environ["HF_HUB_OFFLINE"] = "1"
# One OpenMP thread in every child process too: the suite runs as 2 pytest-xdist workers on 2 cores (README), and
# children at torch's default of one thread per core would oversubscribe them (busy-waiting OpenMP: many times slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from PIL import Image

from diffalign.config.compose import CONFIG_DIR, setup_hydra
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.types import RewardOutput

REPO = Path(__file__).resolve().parents[1]
"""The repository root (the folder holding ``diffalign/`` and ``tests/``)."""

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
"""Environment of a child ``python`` running this checkout: one thread, offline, the repository importable."""

DURATIONS = REPO / "tests" / "durations.txt"
"""Recorded seconds of the suite's slowest tests (pytest's ``--durations`` lines), read by `longest_files_first`."""


def recorded_seconds_per_file(path: Path = DURATIONS) -> dict[str, float]:
    """Seconds per test file (``tests/...py``), summed over the setup, call and teardown lines of a pytest
    ``--durations`` listing (``176.20s call     tests/learning/test_learning.py::test_...``); ``#`` lines are
    comments. Raises ValueError naming the line that is neither."""
    seconds: dict[str, float] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split(maxsplit=2)  # (a parametrized node id may hold spaces)
        if len(fields) != 3 or not fields[0].endswith("s") or fields[1] not in ("setup", "call", "teardown"):
            raise ValueError(f"{path}:{number}: {line!r} is not a pytest --durations line "
                             "('<seconds>s <setup|call|teardown> <node id>'); paste that section of a run's output")
        file = fields[2].split("::")[0]
        seconds[file] = seconds.get(file, 0.0) + float(fields[0][:-1])
    return seconds


def longest_files_first(items: list, seconds_per_file: dict[str, float]) -> list:
    """`items` (pytest items, or anything with a ``nodeid``) with the files of most recorded seconds first. A file's
    items stay together and in their order (module- and class-scoped fixtures are built once per worker, not again
    after another file's test); files without a record follow in collection order."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))

    def key(item) -> tuple[float, int]:
        file = item.nodeid.split("::")[0]
        return -seconds_per_file.get(file, 0.0), first_seen[file]

    return sorted(items, key=key)


def pytest_collection_modifyitems(config, items) -> None:
    """Starts the longest test files first (`longest_files_first`, `DURATIONS`): pytest-xdist's ``worksteal`` hands
    each worker a contiguous share of the collection, run in order, and an idle worker steals the end of the busiest
    share, so a long test collected last would run alone at the end. Only the order changes: nothing is removed (the
    ``-m``/``-k`` deselection keeps the order)."""
    items[:] = longest_files_first(items, recorded_seconds_per_file())


# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP oversubscription makes every op
# 30-40x slower; one thread keeps the suite fast and its timing stable.
torch.set_num_threads(1)

# The SD1.5 DDIM scheduler config, written out here independently of the code under test.
SD15_DDIM_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "clip_sample": False,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}


def step_sampler(policy, *, num_inference_steps: int = 20, guidance_scale: float = 4.0, noise: float = 1.0,
                 sde_type: str | None = None):
    """The step sampler of the policy's family (DDIM with eta=`noise`, or the flow SDE with noise_level=`noise`;
    ``sde_type="dance"``: DanceGRPO's SDE), with the defaults of the old ``rollout(...)`` keyword arguments."""
    from diffalign.samplers.base import sampler_class

    flow = policy.prediction_type == "flow"
    name = "dance_sde" if sde_type == "dance" else "flow_sde" if flow else "ddim"
    return sampler_class(name)(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                               **{"noise_level" if flow or sde_type == "dance" else "eta": noise})


def perturb_lora_(policy, std: float = 0.2, seed: int = 1) -> None:
    """Gives every LoRA matrix random values in place (fresh LoRA B matrices are zero, so the adapter would be a no-op
    and tests comparing adapted vs base outputs could not fail)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.trainable_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


@pytest.fixture
def release_run_locks():
    """``diffalign-train`` run in this process keeps the run lock of a refused run until the process exits (Hydra
    skips its end-of-run callbacks on SystemExit; the CLI exits there): release what a test took."""
    from diffalign.runtime import runlock

    before = set(runlock._HELD)
    yield
    for key in set(runlock._HELD) - before:
        runlock._HELD[key].count = 1
        runlock.release(key)


def run_cli_in_process(command, args: list[str], cwd: Path, monkeypatch, capsys, prog: str = "diffalign-train"):
    """``<prog> <args>`` (`command`: ``diffalign.cli.train``; ``diffalign.cli.evaluate`` with ``prog="diffalign-eval"``)
    run in this process from `cwd`, for tests about what the command does rather than about its process (a child's start
    imports torch, diffusers and every reward: ~10-20 s on 2 shared cores). Returns a ``subprocess.CompletedProcess``
    as the child would have ended: its exit status (1 for a string exit code, which Python prints to stderr) and
    what it wrote to stdout and stderr. An exception escaping the command (a traceback) is raised here. The root
    logger's handlers and level (Hydra's job logging sets them) are restored afterwards; a refused run's lock is not
    (take the ``release_run_locks`` fixture)."""
    import logging
    import subprocess
    import sys

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [prog, *args])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    code = 0
    try:
        command()
    except SystemExit as ended:
        code = ended.code
    finally:
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:], root.level = handlers, level
    out, err = capsys.readouterr()
    if isinstance(code, str):
        code, err = 1, err + code + "\n"
    return subprocess.CompletedProcess(args, code or 0, out, err)


@pytest.fixture
def sd15_ddim_config() -> dict:
    """A copy of the SD1.5 DDIM scheduler config."""
    return dict(SD15_DDIM_CONFIG)


@pytest.fixture
def tiny_policy():
    """Tiny random SD policy (base seed 0, LoRA rank 4) whose LoRA weights are perturbed (see `perturb_lora_`)."""
    torch.manual_seed(0)
    policy = build_tiny_random_policy(seed=0)
    perturb_lora_(policy)
    return policy


@pytest.fixture
def perturb_lora():
    """The `perturb_lora_(policy, std=0.2, seed=1)` helper, for tests that build their own policies."""
    return perturb_lora_


def same_state(x, y) -> bool:
    """Whether two checkpoint states (nested dicts / lists / tuples of tensors and plain values, as `torch.load` gives
    them back) are equal bit for bit: tensors of one dtype with equal elements, containers of one type and length,
    NaN equal to NaN (a metric of a run that tracks nothing), anything else by ``==``."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same_state(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same_state(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and math.isnan(x):
        return isinstance(y, float) and math.isnan(y)
    return x == y


# ------------------------------------------------------------------------------------------------- config helpers


def load_script(name: str, module_name: str | None = None):
    """``scripts/<name>.py`` executed as a fresh module (each call a new one, as running the script would be),
    registered in ``sys.modules`` under `module_name` (default `name`: a script's dataclasses look their module up by
    name), with ``scripts/`` on ``sys.path`` for a script that imports another."""
    import importlib.util
    import sys

    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(module_name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def compose_cfg(overrides: list[str], name: str = "train"):
    """The config `name` (``train`` or ``evaluate``) composed with `overrides`, as ``diffalign-train`` would."""
    setup_hydra()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides, return_hydra_config=False)


def smoke_overrides(tmp_path: Path, steps: int = 2) -> list[str]:
    """A `steps`-update preference run of the tiny random model on 16 renderer pairs into `tmp_path`, no evaluation."""
    return [f"output_dir={tmp_path}", "model=tiny_random", f"trainer.max_steps={steps}", "trainer.batch_size=2",
            "trainer.checkpointing_steps=1", "trainer.keep_last=-1", "trainer.log_with=none", "eval.enabled=false",
            "data=shapes_pairs", "data.num_pairs=16", "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=0"]


def online_overrides(tmp_path, epochs: int = 2) -> list[str]:
    """A short online run into `tmp_path`: `epochs` epochs of 2 groups of 4, 4 sampler steps, no evaluation."""
    return [f"output_dir={tmp_path}", f"online.num_epochs={epochs}", "online.groups_per_epoch=2",
            "online.group_size=4", "online.checkpointing_epochs=1", "trainer.keep_last=-1", "trainer.batch_size=8",
            "trainer.log_with=none", "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=0", "eval.enabled=false",
            "sampler.num_inference_steps=4"]


ONLINE_CASES = {
    "dgpo_flow": ["model=tiny_flow_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
                  "method.timesteps_per_epoch=2", "method.old_policy_switch_step=1"],
    "dgpo_sd": ["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
                "method.timesteps_per_epoch=2"],
    "flow_grpo_flow": ["model=tiny_flow_random", "method=flow_grpo", "sampler=flow_sde"],
    "flow_grpo_sd": ["model=tiny_random", "method=flow_grpo", "sampler=ddim"],
    "ddpo_sd": ["model=tiny_random", "method=ddpo", "sampler=ddim", "online.tracker_min_count=2"],
}
"""Every online method on both model families (tiny random models): overrides added to `online_overrides`."""


# ------------------------------------------------------------------------------------------------- method oracles


def boxed_group_loss(loss_theta: torch.Tensor, loss_ref: torch.Tensor, advantages: torch.Tensor, beta: float,
                     group_size: int) -> torch.Tensor:
    """DGPO's per-group loss as the paper writes it, −log σ(−(β/G) Σ_i A_i (ℓθ_i − ℓref_i)) (arXiv:2510.08425 Eq. 17
    with βλ_t = β/G), for one group given as `(G,)` tensors: the oracle the production surrogate's gradient is checked
    against (tests/unit/objectives/test_dgpo.py; its values by hand in tests/unit/objectives/test_dgpo_by_hand.py)."""
    return -torch.nn.functional.logsigmoid(-(beta / group_size) * (advantages * (loss_theta - loss_ref)).sum())


def column(values) -> torch.Tensor:
    """`values` as one-number latents, float32 of shape `(len(values), 1, 1, 1)`."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1, 1)


class OneNumberPolicy:
    """DGPO's stand-in policy (tests/unit/objectives/test_dgpo_by_hand.py, test_dgpo_contract.py): one-number latents
    whose prediction is v (θ, trainable), r (inside `reference()` or a strategy's `use`), o (θ⁻, inside
    `OneNumberOldPolicy.use`; v when not given) or r + 1 (inside "ema"), whatever x_t; the target is ε, so
    ℓ_i = (pred_i − ε_i)². Records every call's mode or name, timestep shape and guidance scale in `calls`."""

    def __init__(self, v, r, o=None):
        self.v = torch.nn.Parameter(column(v))
        self.r, self.o = column(r), column(o if o is not None else v)
        self.mode, self.calls = "theta", []
        self.denoiser = torch.nn.Identity()

    @contextlib.contextmanager
    def switched(self, mode: str):
        previous, self.mode = self.mode, mode
        try:
            yield self
        finally:
            self.mode = previous

    def reference(self):
        return self.switched("reference")

    def add_noise(self, x0, noise, t):
        self.calls.append(("add_noise", tuple(t.shape), None))
        return x0 + noise

    def training_target(self, x0, noise, t):
        self.calls.append(("training_target", tuple(t.shape), None))
        return noise

    def predict(self, x_t, t, cond, guidance_scale=1.0):
        self.calls.append((self.mode, tuple(t.shape), guidance_scale))
        return {"theta": self.v, "reference": self.r, "old": self.o, "ema": self.r + 1}[self.mode]


class OneNumberOldPolicy:
    """θ⁻ for `OneNumberPolicy`: its `use` switches the policy to its o output."""

    def use(self, policy):
        return policy.switched("old")


# --------------------------------------------------------------------------------------------------- data helpers


def png_bytes(colour, size=(8, 8), mode="RGB") -> bytes:
    """A solid-colour PNG of `size`, converted to `mode`, as bytes."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def colour_of(image: torch.Tensor) -> tuple[int, ...]:
    """(3, H, W) float in [0, 1] of a solid image -> its uint8 RGB."""
    return tuple(round(v * 255) for v in image[:, 0, 0].tolist())


def sd15_alphas_cumprod_f64() -> torch.Tensor:
    """ᾱ_t of the SD1.5 scaled_linear schedule, in float64: betas = linspace(sqrt(0.00085), sqrt(0.012), 1000)²."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, dim=0)


class EveryOtherCorrect:
    """Judges the samples it sees, in call order, correct / wrong / correct / ... (a stand-in verifier)."""

    modality = "image"

    def __init__(self):
        self.seen = 0

    def __call__(self, images, prompts, metadata=None):
        n = images.shape[0]
        correct = torch.tensor([(self.seen + k) % 2 == 0 for k in range(n)])
        self.seen += n
        return RewardOutput(correct.float(), info={"correct": correct})


# The tiny world's hand-made images (tests/unit/world): the palette's exact red and blue, and a black 32x32 canvas
# with filled boxes ((y0, y1, x0, x1), rgb), so a test derives the verifier's reading of it by hand.
RED, BLUE = (220, 40, 40), (50, 90, 235)


def world_canvas(*boxes):
    import numpy as np

    img = np.zeros((32, 32, 3), np.uint8)
    for (y0, y1, x0, x1), rgb in boxes:
        img[y0:y1, x0:x1] = rgb
    return img
