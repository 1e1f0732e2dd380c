"""Every setting validated before any work (issue 19 item 2): each case runs ``diffalign-train``'s own entry point in
this process (Hydra composes the command line, the run-lock callback takes the folder, ``_train_main`` validates) with
the training loops replaced by a stub that fails the test, so a case passes only when validation refuses the setting
with ``diffalign: error: …`` naming the field, before any model is built."""

from __future__ import annotations

import functools
import os
import sys

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

from diffalign import cli
from diffalign.config.validation import construct, validate_train_config


@pytest.fixture(autouse=True)
def _release_locks(release_run_locks):
    """Every test here releases the run locks it took (`conftest.release_run_locks`)."""


@pytest.fixture
def train_cli(tmp_path, monkeypatch, capsys):
    """Runs ``diffalign-train <overrides>`` in-process into a fresh folder; returns the refusal message, or None when
    validation lets the config through (the loops are stubbed: nothing is built or trained). A value of the wrong type
    for a field of a structured config (``trainer``, ``online``, ``eval``, ``sampler``, ``method``, ...) is refused
    earlier, while composing, in one line (`diffalign.config.composition`), and that line is returned (Hydra's own
    message, exit 1, for an error that check cannot name)."""
    from diffalign.train import online, preference, prepare

    reached = []
    def constructors_only(cfg):  # what build_run does first (cheap: arguments checked and stored); no model built
        construct(cfg.method, "method")
        construct(cfg.reference, "reference")
        return cfg

    monkeypatch.setattr(prepare, "build_run", constructors_only)
    monkeypatch.setattr(online, "train", lambda cfg: reached.append(cfg) or {})
    monkeypatch.setattr(preference, "train", lambda cfg: reached.append(cfg) or {})
    count = iter(range(1000))

    def run(*overrides: str) -> str | None:
        monkeypatch.setattr(sys, "argv", ["diffalign-train", f"output_dir={tmp_path / f'run{next(count)}'}",
                                          "trainer.log_with=none", "hydra/job_logging=none",
                                          "hydra/hydra_logging=none", *overrides])
        reached.clear()
        try:
            cli.train()
        except SystemExit as refused:
            if refused.code == 1:  # Hydra refused the override while composing (a typed field)
                message = capsys.readouterr().err
                assert "full_key" in message and not reached, message
                return message
            message = str(refused.code)
            assert message.startswith("diffalign: error: ") and not reached, message
            return message
        assert reached, "diffalign-train neither refused the config nor reached the training loop"
        return None

    return run


# ------------------------------------------------------------------------------------------- the issue's cases


@pytest.mark.parametrize("overrides,expected", [
    # trainer.max_grad_norm=0 scales every gradient to 0 (torch's clip_grad_norm_): refused, null means no clipping
    (["trainer.max_grad_norm=0"], (r"trainer.max_grad_norm=0 would scale every gradient to zero.*"
                                  r"trainer.max_grad_norm=null to turn clipping off")),
    (["trainer.max_grad_norm=-1"], r"trainer.max_grad_norm must be a number > 0 or null, got -1"),
    # integers must be integers (trainer is a structured config: refused while composing, in one line)
    (["trainer.max_steps=2.5"], (r"^diffalign: error: trainer.max_steps=2.5: trainer.max_steps must be an integer, "
                                r"got '2.5' \(TrainerConfig.max_steps: int\); pass e.g. trainer.max_steps=100$")),
    (["trainer.max_steps=1e3"], r"trainer.max_steps must be an integer, got '1e3' .*; pass e.g. trainer.max_steps=1000$"),
    (["trainer.batch_size=true"], r"trainer.batch_size must be an integer, got 'true' \(TrainerConfig.batch_size"),
    (["trainer.keep_last=0"], r"trainer.keep_last=0 would delete every checkpoint.*trainer.keep_last=-1"),
    (["trainer.keep_last=-2"], r"trainer.keep_last must be an integer >= -1, got -2"),
    (["model.lora_rank=0"], r"model.lora_rank must be an integer >= 1 or null, got 0"),
    (["model.lora_rank=2.5"], r"model.lora_rank must be an integer >= 1 or null, got 2.5"),
    (["model.torch_dtype=float64"], (r"model.torch_dtype='float64' must be one of \('float32', 'float16', "
                                    r"'bfloat16'\)")),
    (["+model.lora_ranks=4"], (r"model.lora_ranks is not a setting of model=.*StableDiffusionPolicy.from_pretrained; "
                              r"it takes \[.*'lora_rank'")),
    (["trainer.lr_scheduler=linear"], (r"trainer.lr_scheduler='linear' must be one of \('constant_with_warmup', "
                                      r"'cosine'\)")),
    # the optimizer is the trainer.optimizer node: an old key names its new one, before Hydra composes
    (["trainer.learning_rate=1e-3"], r"trainer.learning_rate was renamed: set trainer.optimizer.lr instead"),
    (["trainer.optimizer._target_=torch.optim.SGD"], (r"trainer.optimizer.betas is not an argument of "
                                                      r"torch.optim.SGD; drop it with ~trainer.optimizer.betas")),
    (["trainer.mixed_precision=fp8"], r"trainer.mixed_precision='fp8' must be one of \('no', 'fp16', 'bf16'\)"),
    (["trainer.log_with=tensorbord"], r"trainer.log_with='tensorbord' must be one of \('tensorboard', 'wandb'"),
    (["trainer.cpu=maybe"], r"trainer.cpu must be true or false, got 'maybe' .*; pass e.g. trainer.cpu=false"),
    (["recipe=tiny_ddpo", "sampler.guidance_scale=0.5"], r"sampler.guidance_scale must be a number >= 1, got 0.5"),
    (["eval.sampler.guidance_scale=0.5"], r"eval.sampler.guidance_scale must be a number >= 1, got 0.5"),
    (["sampler@eval.sampler=ddim", "eval.sampler.eta=-1"], r"eval.sampler.eta must be a number >= 0, got -1"),
    (["model=tiny_sd3", "sampler@eval.sampler=ddim"], (r"eval.sampler: sampler=ddim steps eps models .* is a "
                                                        r"rectified-flow model; use sampler@eval.sampler=ode")),
    (["monitor.every=1", "monitor.sampler.num_inference_steps=0"],
     r"monitor.sampler.num_inference_steps must be an integer >= 1, got 0"),
    (["model=tiny_sd3", "monitor.every=1", "sampler@monitor.sampler=ddim"],
     r"monitor.sampler: sampler=ddim steps eps models .* use sampler@monitor.sampler=ode"),
    # keys that moved into the sampler nodes: one line naming the new key (before Hydra composes)
    (["eval.num_inference_steps=50"], (r"eval.num_inference_steps was renamed: set eval.sampler.num_inference_steps "
                                       r"instead \(evaluation samples with the sampler node eval.sampler")),
    (["eval.eta=0.5"], r"eval.eta was renamed: set .* sampler@eval.sampler=ddim eval.sampler.eta=<eta> for an eps/v"),
    (["monitor.guidance_scale=2"], r"monitor.guidance_scale was renamed: set monitor.sampler.guidance_scale instead"),
    (["+monitor.num_inference_steps=2"], r"monitor.num_inference_steps was renamed: set monitor.sampler.num_inference"),
    (["data.sampler.guidance_scale=0.5"], r"data.sampler.guidance_scale must be a number >= 1, got 0.5"),
    (["recipe=tiny_ddpo", "sampler.eta=-0.1"], r"sampler.eta must be a number >= 0, got -0.1"),
    (["seed=-1"], r"seed must be an integer in \[0, 4294967295\], got -1"),
    ([f"seed={2**32}"], r"seed must be an integer in \[0, 4294967295\], got 4294967296"),
    (["eval.seeds=[0,-1]"], r"eval.seeds=\[0, -1\]: every entry must be an integer >= 0, got -1"),
    (["eval.confidence=1.5"], r"eval.confidence must be a number > 0 and < 1, got 1.5"),
    (["eval.video_format=avi"], r"eval.video_format='avi' must be one of \('gif', 'mp4'\)"),
    (["monitor.every=1", "monitor.num_prompts=0"], r"monitor.num_prompts must be an integer >= 1, got 0"),
    (["reward.geneval_shapes.normalize=minmax"], (r"reward.geneval_shapes.normalize='minmax' must be one of "
                                                 r"\('none', 'zscore'\)")),
    (["reward=[jpeg_compressibility]", "data.reward=jpeg_compressibility", "reward.jpeg_compressibility.quality=0"],
     r"reward.jpeg_compressibility.quality must be an integer in \[1, 100\], got 0"),
    (["reward=[clip_score]", "data.reward=clip_score", "reward.clip_score.device=cuda:7"],
     r"reward.clip_score.device=cuda:7 but \d+ CUDA devices are visible here"),
    (["data.samples_per_prompt=0"], r"data.samples_per_prompt must be an integer >= 1, got 0"),
    (["method.beta=-1"], r"method.beta=-1.0 must be > 0"),
    (["reference=ema", "reference.decay=1.0"], r"reference.decay=1.0 must be in \[0, 1\)"),
    (["recipe=tiny_dgpo", "online.group_size=1"], r"online.group_size must be an integer >= 2, got 1"),
    (["recipe=tiny_dgpo", "online.num_epochs=2.5"], r"online.num_epochs must be an integer, got '2.5'"),
    (["recipe=tiny_dgpo", "online.advantage_std=batch"], r"online.advantage_std='batch' must be one of"),
    (["recipe=tiny_dgpo", "online.fuse_rollout_lora=yes"], r"online.fuse_rollout_lora='yes' must be 'auto'"),
    # a typo added with +, as Hydra's own message for the typo suggests: the key would be ignored (it ran the default
    # job); refused with the real key that is closest
    (["+trainer.max_step=2"], (r"trainer.max_step is not a setting of trainer \(TrainerConfig\); did you mean "
                               r"trainer.max_steps\?")),
    (["recipe=tiny_dgpo", "+online.num_epoch=1"], (r"online.num_epoch is not a setting of online .*did you mean "
                                                   r"online.num_epochs")),
    (["+sampler.guidance=3"], r"sampler.guidance is not a setting of sampler .*did you mean sampler.guidance_scale"),
])
def test_a_bad_setting_is_refused_naming_the_field(train_cli, overrides, expected):
    import re

    message = train_cli(*overrides)
    assert re.search(expected, message), message
    assert "Traceback" not in message and "Error in call to target" not in message


def test_a_tracker_whose_package_is_missing_is_refused_naming_it(train_cli):
    """accelerate drops a tracker whose package is missing and logs nothing; validation refuses it instead."""
    from diffalign.train.checks import _trackers

    missing = [t for t in ("wandb", "aim", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "trackio")
               if t not in _trackers()]
    if not missing:
        pytest.skip("every tracker package is installed here")
    message = train_cli(f"trainer.log_with={missing[0]}")
    assert f"trainer.log_with={missing[0]} but its package is not installed" in message
    assert f"pip install {missing[0]}" in message and "trainer.log_with=none" in message


def test_an_online_method_with_gradient_accumulation_is_refused_naming_the_setting_that_applies(train_cli):
    message = train_cli("recipe=tiny_ddpo", "trainer.gradient_accumulation_steps=4")
    assert "trainer.gradient_accumulation_steps=4 is not used by the online loop" in message
    assert "online.updates_per_epoch" in message
    assert train_cli("trainer.gradient_accumulation_steps=4") is None  # the preference loop implements it


@pytest.mark.parametrize("overrides,expected", [
    (["recipe=tiny_ddpo", "trainer.max_steps=50"], "trainer.max_steps=50: the online loop runs online.num_epochs"),
    (["recipe=tiny_dgpo", "trainer.checkpointing_steps=5"], "online.checkpointing_epochs"),
    (["online.num_epochs=3"], "online.num_epochs=3: the online settings are read by the online methods only"),
])
def test_a_command_line_setting_the_loop_would_ignore_is_refused(train_cli, overrides, expected):
    assert expected in train_cli(*overrides)


def test_a_prompt_folder_is_named_as_a_folder(train_cli, tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "mine.txt").write_text("a red circle\n")
    message = train_cli(f"eval.prompts={folder}")
    assert f"eval.prompts='{folder}' is a folder, not a prompt file" in message and "mine.txt" in message
    assert "does not exist" not in message


def test_an_output_dir_under_a_file_is_refused_with_our_message(train_cli, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(sys, "argv", ["diffalign-train", f"output_dir={blocker / 'run'}", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none"])
    with pytest.raises(SystemExit) as refused:
        cli.train()
    assert "cannot be written" in str(refused.value.code) and "on a writable disk" in str(refused.value.code)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_a_read_only_output_dir_is_refused_with_our_message(tmp_path, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        monkeypatch.setattr(sys, "argv", ["diffalign-train", f"output_dir={read_only / 'run'}",
                                          "hydra/job_logging=none", "hydra/hydra_logging=none"])
        with pytest.raises(SystemExit) as refused:
            cli.train()
        message = str(refused.value.code)
        assert f"output_dir='{read_only / 'run'}' cannot be written" in message and "Permission denied" in message
        assert "Traceback" not in message
        # the Python API's own check (validation) says the same about the folder itself
        with pytest.raises(ValueError, match="cannot be written .*Permission denied"):
            validate_train_config(compose_cfg([f"output_dir={read_only}"]))
    finally:
        read_only.chmod(0o755)


def test_validation_refuses_an_unwritable_folder_without_os_access(tmp_path, monkeypatch):
    """The writability check creates a file (`os.access` says yes to root on a read-only mount): a folder where
    creating files fails is refused, here with file creation failing as on a read-only mount."""
    import tempfile

    def read_only_mount(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    cfg = compose_cfg([f"output_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(tempfile, "mkstemp", read_only_mount)
    with pytest.raises(ValueError, match=r"output_dir='.*run' cannot be written \(Read-only file system: .*\); pass "
                                         r"an output_dir=<folder> on a writable disk"):
        validate_train_config(cfg)


# ---------------------------------------------------------------------------------- a sampler of the model's family

SAMPLERS = {"ddim": "eps", "flow_sde": "flow", "dance_sde": "flow", "dpm_ode": "any", "euler_ode": "flow"}
MODELS = {"tiny_sd": "eps", "tiny_random": "eps", "sd15": "eps", "sd21": "eps", "tiny_t2v_random": "eps",
          "sdxl": "eps", "tiny_sdxl_random": "eps", "tiny_sd3": "flow", "tiny_flow_random": "flow",
          "sd35_medium": "flow", "tiny_wan_random": "flow", "tiny_wan_t2v": "flow", "wan21_t2v": "flow",
          "tiny_flux_random": "flow", "tiny_flux": "flow", "flux1_dev": "flow", "tiny_wan22_random": "flow",
          "wan22_t2v_a14b": "flow"}
VIDEO = ("tiny_t2v_random", "tiny_wan_random", "tiny_wan_t2v", "wan21_t2v", "tiny_wan22_random", "wan22_t2v_a14b")


@functools.cache
def _online_base(stochastic: bool, video: bool):
    """A composed online run to put each shipped model and sampler config into: Flow-GRPO for a stochastic sampler,
    DGPO for an ODE solver; a video reward and prompts for a video model."""
    method = ["method=flow_grpo"] if stochastic else ["method=dgpo", "method.timestep_max_index=2",
                                                       "method.timesteps_per_epoch=2"]
    extra = ["model=tiny_t2v_random", "reward=[video_motion]", "online.prompts=video_train", "eval.enabled=false"] if video \
        else []
    return compose_cfg(["output_dir=unused", *method, *extra, "trainer.batch_size=8", "online.group_size=8"])


def _check_pair(sampler: str, model: str, tmp_path) -> None:
    from diffalign.config.compose import CONFIG_DIR

    cfg = _online_base(sampler in ("ddim", "flow_sde", "dance_sde"), model in VIDEO).copy()
    cfg.output_dir = str(tmp_path)
    cfg.model = OmegaConf.load(f"{CONFIG_DIR}/model/{model}.yaml")  # (the shipped configs, as Hydra composes them)
    cfg.sampler = compose_cfg([f"sampler={sampler}"]).sampler  # (a structured option: composed from its schema)
    if SAMPLERS[sampler] != "any" and SAMPLERS[sampler] != MODELS[model]:
        with pytest.raises(ValueError) as refused:
            validate_train_config(cfg)
        message = str(refused.value)
        kind = "is an eps/v-prediction model" if MODELS[model] == "eps" else "is a rectified-flow model"
        assert f"sampler.model_family={SAMPLERS[sampler]}" in message and kind in message, message
        assert ("sampler=ddim" if MODELS[model] == "eps" else "sampler=flow_sde") in message
    else:
        validate_train_config(cfg)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("model", ["tiny_sd", "tiny_sd3"])
def test_a_sampler_of_the_other_model_family_is_refused_in_both_directions(sampler, model, tmp_path):
    """Every shipped sampler on the tiny world's ε and flow models, for the online method that can use it (a
    stochastic sampler: Flow-GRPO; an ODE solver: DGPO): refused exactly when the families differ, naming both and
    the samplers that fit."""
    _check_pair(sampler, model, tmp_path)


@pytest.mark.slow  # (55 validations: ~20 s)
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_shipped_sampler_and_model_pair(sampler, model, tmp_path):
    _check_pair(sampler, model, tmp_path)


def test_the_issue_case_tiny_sd3_with_ddim_and_flow_grpo_is_refused(train_cli):
    message = train_cli("model=tiny_sd3", "sampler=ddim", "method=flow_grpo")
    assert "sampler.model_family=eps" in message and "is a rectified-flow model" in message
    assert "sampler=ddim eta=1.0" in message and "sampler=flow_sde" in message


def test_a_preference_method_does_not_check_the_unused_samplers_family(tmp_path):
    validate_train_config(compose_cfg([f"output_dir={tmp_path}", "model=tiny_sd3", "sampler=ddim"]))


# ----------------------------------------------------------------------------------- every field of the shipped config

def _leaves(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        if OmegaConf.is_interpolation(node, key):  # (e.g. method.sampler: ${sampler}, walked where it is defined)
            continue
        if OmegaConf.is_dict(value):
            yield from _leaves(value, path)
        else:
            yield path, value


BAD = object()


REAL_VALUED = {"lora_alpha"}
"""Fields whose shipped value is written as an integer (``lora_alpha: 8``) but which take any real number."""


NAMES = {"lr_scheduler", "mixed_precision", "log_with", "name", "model_family", "split", "advantage_std",
         "video_format", "torch_dtype", "kl_form", "timestep_selection", "reduction", "map", "aggregation",
         "orientation", "smoothing_padding", "loss_weighting", "kl_reference", "cpp", "prediction_space",
         "rand_cond_schedule", "aaf_mode", "aaf_tie", "sample_cache", "logprob_check", "losers", "scheduler",
         "degradation", "redraw", "selection", "normalize", "dtype", "backbone"}
"""String fields that take one of a list of names (or forms): an unknown name must be refused too."""


def _bad_value(value, key: str):
    """A value of the wrong type for a leaf (an int field gets 2.5, a number "x", a bool "maybe", a list 7; a name
    field an unknown name)."""
    if isinstance(value, str) and key in NAMES:
        return "no-such-name"
    if isinstance(value, bool):
        return "maybe"
    if isinstance(value, int) and key not in REAL_VALUED:
        return 2.5
    if isinstance(value, int):
        return "x"
    if isinstance(value, float):
        return "x"
    if OmegaConf.is_list(value):
        return 7
    return BAD


# the group options whose fields a user sets, and the run that makes validation read them
GROUP_RUNS = {
    "trainer": [[], ["recipe=tiny_ddpo"]],
    "sampler": [["recipe=tiny_ddpo"], ["recipe=tiny_flow_grpo"], ["recipe=tiny_vipo_image", "sampler=dance_sde"],
                ["recipe=tiny_dgpo"], ["recipe=tiny_dgpo", "sampler=euler_ode"]],
    "online": [["recipe=tiny_dgpo"]],
    "eval": [[]],
    "monitor": [["monitor.every=1"]],
    "model": [[f"model={m}", *(["reward=[video_motion]", "eval.prompts=video_heldout", "data=shapes_pairs"]
                                   if m in VIDEO else [])]
              for m in sorted(MODELS) + ["tiny_sd_conv_lora"]],
    "method": [["recipe=tiny_dpo"], ["recipe=tiny_seppo"], ["recipe=tiny_ddspo"],
               ["method=sft", "data=shapes_winners"],
               ["recipe=tiny_dgpo"], ["recipe=tiny_flow_grpo"], ["recipe=tiny_ddpo"], ["recipe=tiny_vipo_image"],
               ["recipe=tiny_diffusion_nft"]],
    "data": [["data=failure_pairs"], ["data=ranked_pairs"], ["data=shapes_pairs"], ["data=shapes_winners",
             "method=sft"], ["recipe=tiny_ddspo"]],
    "reference": [["reference=ema"], ["recipe=tiny_seppo"]],
    "reward": [["reward=[jpeg_compressibility,geneval_shapes]"], ["reward=[clip_score,geneval_shapes]"]],
}
SKIP: set[str] = set()
"""Leaves not walked (none: every typed and name field of the shipped configs is refused when wrong)."""


@pytest.mark.slow  # (about 400 leaves of 30 configs: ~60 s)
@pytest.mark.parametrize("group,overrides", [(g, o) for g, runs in GROUP_RUNS.items() for o in runs],
                         ids=lambda x: x if isinstance(x, str) else "-".join(x) or "default")
def test_every_typed_field_of_the_shipped_configs_refuses_a_value_of_the_wrong_type(group, overrides, tmp_path):
    """Walks every leaf of a shipped config group as composed (int, float, bool, list and name fields) and gives it a
    value of the wrong type (or an unknown name): Hydra's structured config (method, data, reference, reward) or our
    validation must refuse it, naming the field."""
    from omegaconf.errors import ValidationError

    base = compose_cfg([f"output_dir={tmp_path}", *overrides])
    validate_train_config(base)  # the run is valid as composed
    checked = 0
    for path, value in _leaves(base[group], group):
        bad = _bad_value(value, path.rsplit('.', 1)[-1])
        if bad is BAD or path in SKIP or path.endswith("._target_"):
            continue
        cfg = base.copy()
        try:
            OmegaConf.update(cfg, path, bad, force_add=False)
        except ValidationError as err:  # a typed field: Hydra refuses the override the same way
            assert path.split(".")[-1] in str(err), (path, str(err))
            checked += 1
            continue
        with pytest.raises((ValueError, FileNotFoundError)) as refused:
            validate_train_config(cfg)
            construct(cfg.method, "method")  # (constructors check their arguments when built, before any model loads)
            construct(cfg.reference, "reference")
        assert path in str(refused.value) or path.split(".", 1)[1] in str(refused.value), (path, str(refused.value))
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("overrides,expected", [
    (["eval.seeds=[0,-1]"], "eval.seeds=[0, -1]: every entry must be an integer >= 0, got -1"),
    (["eval.sampler.num_inference_steps=2.5"], "eval.sampler.num_inference_steps must be an integer, got '2.5'"),
    (["eval.sampler.num_inference_steps=0"], "eval.sampler.num_inference_steps must be an integer >= 1, got 0"),
    (["eval.guidance_scale=7.5"], "eval.guidance_scale was renamed: set eval.sampler.guidance_scale instead"),
    (["include_base=maybe"], "include_base must be true or false, got 'maybe'"),
    (["reward.geneval_shapes.weight=x"], ("reward.geneval_shapes.weight must be a number, got 'x' "
                                          "(GenevalShapesConfigWithWeight.weight: float)")),
])
def test_diffalign_eval_checks_its_settings_before_any_model_loads(overrides, expected, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(sys, "argv", ["diffalign-eval", f"output_dir={tmp_path / 'eval'}", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none", *overrides])
    with pytest.raises(SystemExit) as refused:
        cli.evaluate()
    said = str(refused.value.code) + capsys.readouterr().err  # (a typed field: Hydra's own message, exit 1)
    assert expected in said and "Traceback" not in said
