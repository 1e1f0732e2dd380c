"""Hydra configuration, bad-input errors, and short end-to-end training runs on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_cfg, run_cli_in_process, smoke_overrides
from omegaconf import OmegaConf
from safetensors.torch import load_file

from diffalign.config.compose import CONFIG_DIR
from diffalign.config.validation import validate_train_config

GROUPS = {g: sorted(p.stem for p in (Path(CONFIG_DIR) / g).glob("*.yaml"))
          for g in ("model", "method", "sampler", "trainer", "data", "eval", "reference", "recipe")}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_group_option_composes(group):
    assert GROUPS[group], group
    for option in GROUPS[group]:
        cfg = compose_cfg([f"{group}={option}"])
        if group not in ("recipe",):
            assert cfg[group] is not None
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves


def test_rewards_are_multi_select_and_eval_config_composes():
    cfg = compose_cfg(["reward=[geneval_shapes,jpeg_compressibility]"])
    assert set(cfg.reward) == {"geneval_shapes", "jpeg_compressibility"}
    assert cfg.reward.jpeg_compressibility.quality == 95
    ecfg = compose_cfg(["checkpoint=null"], name="evaluate")
    assert ecfg.eval.prompts == "heldout" and "geneval_shapes" in ecfg.reward


def test_default_is_the_tiny_world_recipe():
    cfg = compose_cfg([])
    assert cfg.model._target_.endswith("StableDiffusionPolicy.from_pretrained")
    assert Path(cfg.model.pretrained_model_name_or_path).is_dir()
    assert cfg.data._target_.endswith("FailurePairs") and cfg.eval.prompts == "heldout"


def test_commas_inside_quoted_prompt_values():
    cfg = compose_cfg(['+sample.prompt="a red circle, two blue squares"'])
    assert cfg.sample.prompt == "a red circle, two blue squares"


@pytest.mark.parametrize("override,field", [
    ("method.beta=0", "method.beta"),
    ("method.beta=-5", "method.beta"),
    ("sampler.num_inference_steps=0", "sampler.num_inference_steps"),
    ("eval.sampler.num_inference_steps=0", "eval.sampler.num_inference_steps"),
    ("data.prompts=/nonexistent/prompts.jsonl", "data.prompts"),
    ("eval.prompts=/nonexistent/prompts.jsonl", "eval.prompts"),
    ("trainer.mixed_precision=fp8", "trainer.mixed_precision"),
    ("trainer.max_steps=0", "trainer.max_steps"),
])
def test_bad_input_is_rejected_with_the_field_named(override, field):
    from diffalign.config.validation import construct

    cfg = compose_cfg([override])
    with pytest.raises((ValueError, FileNotFoundError), match=field.split(".")[-1]):
        validate_train_config(cfg)
        construct(cfg.method, "method")  # (its constructor's checks: run first when the run is built, no model yet)


def test_a_model_config_without_shipped_weights_names_the_path_to_set():
    """A model config whose path is ``???`` (as ``model=tiny_wan_t2v`` was until its weights shipped): the run is
    refused before any work, with the field named (OmegaConf's own error came from the first code to read the node,
    after the checks)."""
    cfg = compose_cfg(["recipe=tiny_flow_grpo", "model=tiny_wan_t2v", "model.pretrained_model_name_or_path=???",
                       "reward=[video_motion]"])
    with pytest.raises(ValueError, match=r"^model.pretrained_model_name_or_path is not set: .* pass "
                                         r"model.pretrained_model_name_or_path=<a diffusers folder or hub id>$"):
        validate_train_config(cfg)
    validate_train_config(compose_cfg(["recipe=tiny_flow_grpo", "model=tiny_wan_random", "reward=[video_motion]"]))


def test_more_checks_before_any_model_is_loaded(tmp_path):
    dog = tmp_path / "dog.txt"
    dog.write_text("a photo of a dog\n")
    with pytest.raises(ValueError, match="eval.prompts=.*geneval_shapes"):
        validate_train_config(compose_cfg([f"eval.prompts={dog}"]))
    validate_train_config(compose_cfg([f"eval.prompts={dog}", "reward=[jpeg_compressibility]",  # any prompt is fine
                                       "data=shapes_pairs"]))
    with pytest.raises(ValueError, match="trainer.batch_size=32 is larger than data.num_pairs=16"):
        validate_train_config(compose_cfg(["trainer.batch_size=32", "data=shapes_pairs", "data.num_pairs=16"]))
    (tmp_path / "run" / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(ValueError, match="already holds checkpoints; pass resume=latest"):
        validate_train_config(compose_cfg([f"output_dir={tmp_path / 'run'}"]))
    validate_train_config(compose_cfg([f"output_dir={tmp_path / 'run'}", "resume=latest"]))
    # the default output_dir is a new runs/train-<time> folder each time: resume=latest there would silently start over
    with pytest.raises(ValueError, match=r"^resume=latest continues the run in output_dir, but output_dir is the "
                                         r"default, a new folder \(runs/train-\d{8}-\d{6}\); pass output_dir="):
        validate_train_config(compose_cfg(["resume=latest"]))
    validate_train_config(compose_cfg(["resume=latest", f"output_dir={tmp_path / 'not-yet'}"]))  # a first launch
    with pytest.raises(FileNotFoundError, match="eval.prompts="):
        validate_train_config(compose_cfg(["eval.prompts=/nope.jsonl"]))


def test_resuming_a_finished_run_is_a_no_op(tmp_path):
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path, steps=2) + ["trainer.checkpointing_steps=5"]))
    before = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    results = train(compose_cfg(smoke_overrides(tmp_path, steps=2) + ["trainer.checkpointing_steps=5", "resume=latest"]))
    assert results["global_step"] == 2
    after = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_empty_prompt_file_is_rejected(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        validate_train_config(compose_cfg([f"eval.prompts={empty}"]))


def _cli(args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str]:
    """``diffalign-train <args>`` in this process (`conftest.run_cli_in_process`): its exit status and stderr."""
    from diffalign import cli

    done = run_cli_in_process(cli.train, args, cwd, monkeypatch, capsys)
    return done.returncode, done.stderr


def test_cli_errors_before_any_model_is_loaded(tmp_path, monkeypatch, capsys, release_run_locks):
    # unknown method: Hydra names the group and lists the options
    code, err = _cli(["method=nope", f"output_dir={tmp_path / 'a'}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "method" in err and "diffusion_dpo" in err
    # beta <= 0: our validation, before the (absent) model path would be touched
    code, err = _cli(["method.beta=0", f"output_dir={tmp_path / 'b'}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "method.beta=0.0 must be > 0" in err  # (the constructor's check)
    assert "from_pretrained" not in err and "instantiate" not in err and "Traceback" not in err
    # with a missing model folder too: the config checks name the folder first, before the method is even built
    code, err = _cli(["method.beta=0", "model.pretrained_model_name_or_path=/does/not/exist",
                      f"output_dir={tmp_path / 'b2'}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "Model folder '/does/not/exist' does not exist" in err
    assert "Traceback" not in err
    code, err = _cli(["reward=[nope]", f"output_dir={tmp_path / 'c'}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and "reward" in err and "geneval_shapes" in err
    # a comma without quotes is ambiguous without --multirun; no training step runs
    code, err = _cli(["+sample.prompt=a,b", f"output_dir={tmp_path / 'd'}"], tmp_path, monkeypatch, capsys)
    assert code != 0 and not list((tmp_path / "d").glob("checkpoint-*"))


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(folder.rglob("*"))}


def test_a_refused_run_leaves_its_folder_as_it_was(tmp_path, monkeypatch, capsys, release_run_locks):
    """A config error found after Hydra made the output folder (``runs/train-<time>/`` with ``.hydra/`` and
    ``cli.log``): the one error line, and the folder is gone (created by this run, with its ``runs/`` parent), or put
    back byte for byte where it existed (a refused ``resume=latest`` must not replace the run's saved config, which
    ``diffalign-eval`` reads to pick the model)."""
    from diffalign import cli

    for args in (["method.beta=-1"], ["method.beta=-1", "output_dir=a/b"], ["trainer.batch_size=0"]):
        done = run_cli_in_process(cli.train, args, tmp_path, monkeypatch, capsys)
        assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("diffalign: error: "), args
        assert list(tmp_path.iterdir()) == [], (args, list(tmp_path.rglob("*")))
    done = run_cli_in_process(cli.evaluate, [f"checkpoint={tmp_path / 'nope'}"], tmp_path, monkeypatch, capsys,
                              prog="diffalign-eval")
    assert done.returncode == 1 and "diffalign: error: checkpoint=" in done.stderr
    assert list(tmp_path.iterdir()) == []
    run = tmp_path / "run"  # an earlier run's folder: its saved config, its log, a checkpoint
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("model:\n  _target_: the.earlier.run\n")
    (run / "cli.log").write_text("the earlier run's log\n")
    (run / "checkpoint-4").mkdir()
    before = _tree(run)
    done = run_cli_in_process(cli.train, ["output_dir=run", "resume=latest", "model=tiny_sd3", "method.beta=-1"],
                              tmp_path, monkeypatch, capsys)
    assert done.returncode == 1 and "method.beta=-1.0 must be > 0" in done.stderr
    assert _tree(run) == before  # (no hydra.yaml / overrides.yaml added, no lock file left)
    (tmp_path / "empty").mkdir()
    done = run_cli_in_process(cli.train, ["output_dir=empty", "method.beta=-1"], tmp_path, monkeypatch, capsys)
    assert done.returncode == 1 and (tmp_path / "empty").is_dir() and _tree(tmp_path / "empty") == {}


def test_two_step_run_changes_every_trainable_parameter_and_lora_loads_in_diffusers(tmp_path):
    from diffalign.models.tiny_random import build_tiny_random_pipeline, build_tiny_random_policy
    from diffalign.train.preference import train

    # LoRA on attention and ResNet convolutions, as the default recipe's model (tiny_sd_conv_lora): diffusers must
    # read the saved adapter back whole (a mix of diffusers and PEFT key names would lose the attention layers)
    targets = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]
    assert list(compose_cfg(["model=tiny_sd_conv_lora"]).model.lora_target_modules) == targets
    cfg = compose_cfg(smoke_overrides(tmp_path, steps=2) + [f"+model.lora_target_modules=[{','.join(targets)}]"])
    # diffusers' save_lora_weights prefixes UNet keys with "unet."
    initial = {f"unet.{k}": v for k, v in
               build_tiny_random_policy(seed=0, lora_target_modules=targets).lora_state_dict().items()}
    assert any(".conv1.lora_A" in k for k in initial)
    results = train(cfg)
    assert results["global_step"] == 2
    final = load_file(tmp_path / "final" / "pytorch_lora_weights.safetensors")
    assert set(final) == set(initial) and len(final) > 0
    for key, value in initial.items():
        assert not torch.equal(final[key], value), f"{key} did not change"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2

    # the saved LoRA in a plain diffusers pipeline gives the run's policy's images
    policy = build_tiny_random_policy(seed=0, lora_target_modules=targets)
    policy.load_lora_weights(tmp_path / "final")
    pipe = build_tiny_random_pipeline(seed=0)
    pipe.load_lora_weights(tmp_path / "final")
    kwargs = {"num_inference_steps": 3, "guidance_scale": 3.0, "output_type": "pt"}
    ours = policy.to_pipeline()(["a red circle"], generator=torch.Generator().manual_seed(3), **kwargs).images
    theirs = pipe(["a red circle"], generator=torch.Generator().manual_seed(3), **kwargs).images
    assert torch.allclose(ours, theirs, atol=1e-5)
    base = build_tiny_random_pipeline(seed=0)(["a red circle"], generator=torch.Generator().manual_seed(3),
                                              **kwargs).images
    assert not torch.allclose(ours, base, atol=1e-4)


def test_resume_continues_exactly(tmp_path):
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path / "a", steps=4)))
    train(compose_cfg(smoke_overrides(tmp_path / "b", steps=2)))
    train(compose_cfg(smoke_overrides(tmp_path / "b", steps=4) + ["resume=latest"]))
    a = load_file(tmp_path / "a" / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "b" / "final" / "pytorch_lora_weights.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    sa = json.loads((tmp_path / "a" / "checkpoint-4" / "trainer_state.json").read_text())
    sb = json.loads((tmp_path / "b" / "checkpoint-4" / "trainer_state.json").read_text())
    assert sa.pop("lineage") != sb.pop("lineage")  # two runs (b's own lineage carried over its resume)...
    assert sa == sb  # ...in the same state


def test_eval_command_writes_grids_metrics_and_per_image_seeds(tmp_path):
    from diffalign.cli import _eval_main
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path / "run", steps=1)))
    cfg = compose_cfg(["model=tiny_random", f"checkpoint={tmp_path / 'run' / 'final'}", f"output_dir={tmp_path / 'ev'}",
                       "eval.prompts_per_tag=2", "eval.seeds=[10,11]", "eval.sampler.num_inference_steps=2"],
                      name="evaluate")
    _eval_main(cfg)
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert set(metrics["variants"]) == {"base", "checkpoint"}
    assert "geneval_shapes/accuracy_gain" in metrics["checkpoint_vs_base"]
    assert (tmp_path / "ev" / "base_grid.png").is_file() and (tmp_path / "ev" / "checkpoint_grid.png").is_file()
    samples = [json.loads(line) for line in (tmp_path / "ev" / "samples.jsonl").read_text().splitlines()]
    n_prompts = metrics["num_prompts"]
    assert len(samples) == 2 * 2 * n_prompts  # 2 variants x 2 seeds
    first = samples[n_prompts + 1]  # seed 11, prompt 1
    assert (first["seed"], first["prompt_index"], first["image_seed"]) == (11, 1, 11 * 1_000_003 + 1)
    missing = compose_cfg(["model=tiny_random", f"checkpoint={tmp_path / 'nothing'}"], name="evaluate")
    with pytest.raises(SystemExit, match="checkpoint"):
        _eval_main(missing)


def test_eval_command_builds_the_adapter_the_checkpoint_was_trained_with(tmp_path):
    """A run whose model config changed the LoRA (rank 2, convolutions too) evaluates with the plain model config: the
    adapter settings come from the LoRA file, and the sampled images are the trained policy's."""
    import numpy as np
    from PIL import Image

    from diffalign.cli import _eval_main
    from diffalign.evaluation.generation import eval_config_from, sample_images
    from diffalign.models.base import saved_lora_settings
    from diffalign.models.tiny_random import build_tiny_random_policy
    from diffalign.train.preference import train

    targets = ["conv1", "conv2", "to_k", "to_out.0", "to_q", "to_v"]
    train(compose_cfg(smoke_overrides(tmp_path / "run", steps=1) + [
        "model.lora_rank=2", f"+model.lora_target_modules=[{','.join(targets)}]"]))
    assert saved_lora_settings(tmp_path / "run" / "final") == {"lora_rank": 2, "lora_alpha": 2,
                                                               "lora_target_modules": targets}
    cfg = compose_cfg(["model=tiny_random", f"checkpoint={tmp_path / 'run' / 'final'}", f"output_dir={tmp_path / 'ev'}",
                       "eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=2",
                       "include_base=false"], name="evaluate")
    _eval_main(cfg)
    policy = build_tiny_random_policy(seed=0, lora_rank=2, lora_target_modules=targets)
    policy.load_lora_weights(tmp_path / "run" / "final")
    sample = json.loads((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()[0])
    p = sample["prompt_index"]
    rows = [{"prompt": sample["prompt"]}] * (p + 1)  # sample_images reads rows[p] only
    expected = sample_images(policy, [(p, 0)], rows, eval_config_from(cfg.eval), use_reference=False)[0]
    written = np.asarray(Image.open(tmp_path / "ev" / sample["image"]).convert("RGB"))
    assert np.abs(written.astype(int) - (expected.permute(1, 2, 0).numpy() * 255).round().astype(int)).max() <= 1


@pytest.mark.parametrize("overrides,match", [
    (["reward=[video_motion]"], (r"reward=\[...video_motion...\]: video_motion scores videos .* makes images; .* "
                                 r"or a video model \(e.g. model=tiny_wan_t2v\)")),  # the hint: a shipped model
    (["model=tiny_random", "reward=[geneval_shapes,temporal_consistency]"], "temporal_consistency scores videos"),
    (["model=tiny_sd3", "eval_reward=[per_frame]"], r"eval_reward=\[...per_frame...\]"),
    (["recipe=tiny_vipo_wan", "reward=[geneval_shapes]"], "makes videos; wrap it per frame"),
    (["recipe=tiny_vipo_wan", "eval_reward=[clip_score]"], "eval_reward.per_frame.image_reward=clip_score"),
    (["recipe=tiny_vipo_wan", "monitor.every=1", "monitor.prompts=heldout"], "monitor.prompts=video_heldout"),
    (["monitor.every=1", "monitor.prompts=video_heldout"], "monitor.prompts=heldout"),
])
def test_reward_of_the_other_modality_is_refused_before_any_model_loads(overrides, match, tmp_path):
    """A video reward on an image model (and an image reward on a video model) fails in validation, naming the field
    and the fix (issue 10 item 4); the matching pairs pass."""
    with pytest.raises(ValueError, match=match):
        validate_train_config(compose_cfg([f"output_dir={tmp_path}"] + overrides))


@pytest.mark.parametrize("overrides", [
    ["recipe=tiny_vipo_wan"],
    ["recipe=tiny_vipo_wan", "monitor.every=5"],
    ["recipe=tiny_vipo_wan", "reward=[per_frame,temporal_consistency]"],
    ["model=tiny_wan_random", "reward=[video_motion]", "eval.enabled=false", "data=shapes_pairs"],
    ["model=tiny_sd3", "reward=[geneval_shapes,clip_score]"],
])
def test_rewards_of_the_models_modality_pass_validation(overrides, tmp_path):
    validate_train_config(compose_cfg([f"output_dir={tmp_path}"] + overrides))


def test_eval_command_refuses_checkpoints_trained_with_different_lora_settings(tmp_path):
    from diffalign.cli import _eval_main
    from diffalign.models.tiny_random import build_tiny_random_policy

    build_tiny_random_policy(seed=0, lora_rank=2).save_lora_weights(tmp_path / "a")
    build_tiny_random_policy(seed=0, lora_rank=4).save_lora_weights(tmp_path / "b")
    cfg = compose_cfg(["model=tiny_random", f"checkpoints=[{tmp_path / 'a'},{tmp_path / 'b'}]",
                       f"output_dir={tmp_path / 'ev'}"], name="evaluate")
    with pytest.raises(SystemExit, match="different LoRA settings"):
        _eval_main(cfg)
    assert not (tmp_path / "ev" / "samples.jsonl").exists()  # refused before anything was sampled


def test_help_names_the_command_and_lists_only_groups_to_choose(tmp_path, monkeypatch, capsys):
    """``--help`` begins with the command's name and what it does, not Hydra's default, the module's (``cli is powered
    by Hydra.``); its group list is the config folder's groups (and the registered rewards), not the ``schema/*``
    structured configs the checks use, nor ``accelerate/`` (launch configs, refused as ``+accelerate=...``)."""
    from diffalign import cli

    for command, prog in ((cli.train, "diffalign-train"), (cli.evaluate, "diffalign-eval")):
        done = run_cli_in_process(command, ["--help"], tmp_path, monkeypatch, capsys, prog=prog)
        assert done.returncode == 0 and done.stdout.splitlines()[0].startswith(f"{prog}: "), done.stdout[:200]
        groups = done.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
        listed = {line.split(":")[0] for line in groups.splitlines() if ": " in line}
        assert {"model", "method", "sampler", "recipe", "reward", "trainer"} <= listed, listed
        assert not any(g.startswith(("schema", "hydra", "accelerate")) for g in listed), listed
        model_line = next(line for line in groups.splitlines() if line.startswith("model: "))
        assert set(model_line.removeprefix("model: ").split(", ")) == set(GROUPS["model"])  # (the folder's files)
        assert list(tmp_path.iterdir()) == []
