"""Starting a run from a saved LoRA (``model.init_lora``, diffalign/lora/initial.py; docs/guides/lora.md) on the
shipped tiny SD and SD3 models: each reference strategy with it, the settings taken from the file, resume winning over
it, and the errors raised before any model loads."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import safetensors.torch
import torch
from conftest import compose_cfg, online_overrides, perturb_lora_, run_cli_in_process
from diffusers import StableDiffusionPipeline

from diffalign.config.compose import asset_path
from diffalign.lora.initial import adopt_init_lora, build_policy
from diffalign.lora.io import policy_lora, read_lora, write_kohya
from diffalign.models.sd3 import StableDiffusion3Policy
from diffalign.models.stable_diffusion import StableDiffusionPolicy
from diffalign.reference.ema import EmaReference
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.reference.pool import PoolReference

LN2 = float(torch.tensor(math.log(2.0)))  # ln 2 in float32, the loss's dtype


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    """A random LoRA (r 4, alpha 2: not the models' configured r 8 / alpha 8) for each tiny model, as a diffalign folder
    and as a kohya file."""
    root = tmp_path_factory.mktemp("loras")
    sd = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), lora_rank=4, lora_alpha=2,
                                               lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1"])
    sd3 = StableDiffusion3Policy.from_pretrained(asset_path("tiny_sd3"), load_t5=False, max_sequence_length=8,
                                             lora_rank=4, lora_alpha=2)
    out = {}
    for name, policy in (("tiny_sd", sd), ("tiny_sd3", sd3)):
        perturb_lora_(policy, std=0.05)
        policy.save_lora_weights(root / name)
        out[name] = {"folder": root / name, "kohya": write_kohya(policy_lora(policy), root / f"{name}.safetensors")}
    return out


def dpo_overrides(tmp_path, model: str, steps: int = 1) -> list[str]:
    return [f"output_dir={tmp_path}", f"model={model}", "method=diffusion_dpo_tiny", "data=shapes_pairs",
            "data.num_pairs=8", f"trainer.max_steps={steps}", "trainer.batch_size=2", "trainer.log_with=none",
            "trainer.checkpointing_steps=1", "eval.enabled=false"]


def first_step(results: dict) -> dict:
    return results["history_tail"][0]


@pytest.mark.parametrize("model", ["tiny_sd", "tiny_sd3"])
def test_reference_checkpoint_with_the_init_lora_starts_at_ln2(tmp_path, loras, model):
    """The policy starts from the kohya file, the reference is the same LoRA as a diffalign folder: z = 0 for every
    pair, so the first Diffusion-DPO loss is ln 2 exactly; with the adapter-free base as the reference it is not."""
    from diffalign.train.preference import train

    init = f"model.init_lora={loras[model]['kohya']}"
    same = train(compose_cfg(dpo_overrides(tmp_path / "ckpt", model) + [
        init, "reference=checkpoint", f"reference.path={loras[model]['folder']}"]))
    assert first_step(same)["loss"] == LN2
    assert first_step(same)["rewards/margins"] == 0.0
    base = train(compose_cfg(dpo_overrides(tmp_path / "base", model) + [init, "reference=frozen_base"]))
    assert abs(first_step(base)["loss"] - LN2) > 1e-4


def test_frozen_base_with_the_init_lora_mirrors_the_base_policy_with_the_lora_as_reference(tmp_path, loras):
    """reference=frozen_base is the adapter-free base: a run starting from the LoRA against the base sees the same
    denoising losses as a run starting from the base (fresh adapter, B = 0) against the LoRA, with the roles swapped."""
    from diffalign.train.preference import train

    lora = loras["tiny_sd"]["kohya"]
    a = first_step(train(compose_cfg(dpo_overrides(tmp_path / "a", "tiny_sd") + [
        f"model.init_lora={lora}", "reference=frozen_base"])))
    settings = read_lora(lora).settings
    b = first_step(train(compose_cfg(dpo_overrides(tmp_path / "b", "tiny_sd") + [
        "reference=checkpoint", f"reference.path={lora}", f"model.lora_rank={settings['lora_rank']}",
        f"model.lora_alpha={settings['lora_alpha']}",
        f"++model.lora_target_modules=[{','.join(settings['lora_target_modules'])}]"])))
    for side in ("chosen", "rejected"):
        assert a[f"model_loss/{side}"] == b[f"ref_loss/{side}"]
        assert a[f"ref_loss/{side}"] == b[f"model_loss/{side}"]
    assert a["rewards/margins"] == pytest.approx(-b["rewards/margins"], rel=1e-5)
    assert abs(a["rewards/margins"]) > 1e-6


def test_flow_grpo_kl_is_zero_against_the_init_lora_and_not_against_the_base(tmp_path, loras):
    from diffalign.train.online import train

    lora = loras["tiny_sd3"]["kohya"]
    common = ["model=tiny_sd3", "method=flow_grpo", "sampler=flow_sde", "method.beta_kl=0.04",
              "online.groups_per_epoch=1", "sampler.num_inference_steps=3", "reward=[brightness]",
              f"model.init_lora={lora}"]
    same = train(compose_cfg(online_overrides(tmp_path / "ckpt", epochs=1) + common + [
        "reference=checkpoint", f"reference.path={lora}"]))
    assert first_step(same)["kl"] == 0.0
    base = train(compose_cfg(online_overrides(tmp_path / "base", epochs=1) + common + ["reference=frozen_base"]))
    assert first_step(base)["kl"] > 0


def test_the_policy_computes_the_file_and_each_reference_starts_where_documented(tmp_path, loras):
    """The policy built from a kohya file equals diffusers' pipeline with that file loaded; frozen_base equals the
    pipeline without it; EMA and pool references start at the init LoRA."""
    lora = loras["tiny_sd"]["kohya"]
    cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={lora}"])
    logged = []
    policy = build_policy(cfg, log=logged.append)
    assert "starts from" in logged[0] and "kohya format" in logged[0]
    assert policy.denoiser.peft_config["default"].r == 4 and policy.denoiser.peft_config["default"].lora_alpha == 2
    pipe = StableDiffusionPipeline.from_pretrained(asset_path("tiny_sd"), safety_checker=None,
                                                   requires_safety_checker=False)
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, pipe.unet.config.cross_attention_dim,
                                                                   generator=g)
    t = torch.tensor([20, 800])

    def out(unet):
        with torch.no_grad():
            return unet(x, t, encoder_hidden_states=text).sample

    bare = out(pipe.unet)
    with FrozenBaseReference().use(policy):
        assert torch.equal(out(policy.unet), bare)
    pipe.load_lora_weights(str(lora))
    torch.testing.assert_close(out(policy.unet), out(pipe.unet), rtol=0, atol=1e-6)
    for reference in (EmaReference(decay=0.9), PoolReference(save_every=1, keep=2)):
        reference.setup(policy)
        reference.on_step(policy, 0)
        file = read_lora(lora).state
        assert all(torch.equal(reference.adapter.params[k], file[k].float()) for k in file)
        policy.denoiser.delete_adapters(reference.adapter.adapter_name)


@pytest.mark.parametrize("model", ["tiny_t2v_random", "tiny_wan_random"])
def test_video_models_start_from_their_saved_lora(tmp_path, model):
    """A video UNet and a Wan transformer; their builders take no lora_target_modules, so their own targets stay
    (and must be the file's)."""
    from hydra.utils import instantiate

    from diffalign.lora.initial import model_config

    saved = instantiate(model_config(compose_cfg([f"output_dir={tmp_path}", f"model={model}"]).model))
    perturb_lora_(saved)
    saved.save_lora_weights(tmp_path / "lora")
    policy = build_policy(compose_cfg([f"output_dir={tmp_path}", f"model={model}", f"model.init_lora={tmp_path / 'lora'}"]),
                          log=lambda _: None)
    want, got = policy_lora(saved).state, policy_lora(policy).state
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)


def test_reference_path_of_another_alpha_is_refused(loras):
    """The reference adapter copies the policy's config: a LoRA of the same rank but another alpha would run at the
    policy's scale, so it is refused naming both."""
    from diffalign.reference.checkpoint import CheckpointReference

    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"), lora_rank=4, lora_alpha=4,
                                                   lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1"])
    with pytest.raises(ValueError, match=r"reference.path=.* has r=4, alpha=2 but the policy's adapter r=4, alpha=4"):
        CheckpointReference(str(loras["tiny_sd"]["kohya"])).setup(policy)


def test_settings_come_from_the_file_and_an_explicit_conflict_names_both(tmp_path, loras):
    lora = loras["tiny_sd"]["kohya"]
    cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={lora}"])
    assert cfg.model.lora_rank == 8  # tiny_sd's
    adopted = adopt_init_lora(cfg)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha) == (4, 2) == (adopted["lora_rank"], adopted["lora_alpha"])
    assert cfg.model.lora_target_modules == ["conv1", "to_k", "to_out.0", "to_q", "to_v"]  # diffalign's metadata
    assert adopt_init_lora(cfg, explicit={"lora_rank", "lora_alpha"}) == adopted  # equal explicit values are fine
    bare = tmp_path / "no-metadata.safetensors"  # a kohya file from elsewhere: the adapted modules' full paths
    safetensors.torch.save_file(safetensors.torch.load_file(lora), str(bare))
    cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={bare}"])
    adopt_init_lora(cfg)
    assert sorted(cfg.model.lora_target_modules) == read_lora(lora).modules and len(read_lora(lora).modules) == 40
    assert build_policy(cfg, log=lambda _: None).denoiser.peft_config["default"].r == 4

    for override, match in (("model.lora_rank=16", (r"model.lora_rank=16 \(set on the command line\) conflicts with "
                                                    r"model.init_lora=.* which has rank 4")),
                            ("model.lora_alpha=4", "model.lora_alpha=4 .* which has alpha 2"),
                            ("model.lora_rank=null", "model.lora_rank=None .* which has rank 4"),
                            ("++model.lora_target_modules=[to_q]", "which adapts modules these targets miss")):
        cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={lora}", override])
        with pytest.raises(ValueError, match=match):
            adopt_init_lora(cfg, explicit={override.split("=")[0].lstrip("+").removeprefix("model.")})
    # explicit targets that cover the file's modules (here listed by full path) are kept
    cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={bare}",
                                                            "++model.lora_target_modules=[to_q,to_k,to_v,to_out.0,conv1]"])
    assert adopt_init_lora(cfg, explicit={"lora_target_modules"})["lora_target_modules"] == [
        "to_q", "to_k", "to_v", "to_out.0", "conv1"]
    assert build_policy(cfg, log=lambda _: None).denoiser.peft_config["default"].r == 4
    # a diffalign folder restores the run's own (compact) targets from its metadata
    cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={loras['tiny_sd']['folder']}"])
    assert adopt_init_lora(cfg)["lora_target_modules"] == sorted(["to_q", "to_k", "to_v", "to_out.0", "conv1"])


def test_bad_init_lora_fails_before_any_model_loads(tmp_path, loras, monkeypatch):
    import diffusers

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained", no_loading)
    cases = ((str(tmp_path / "missing.safetensors"), FileNotFoundError, "model.init_lora=.*does not exist"),
             (str(loras["tiny_sd3"]["kohya"]), ValueError, "is a LoRA for a transformer, but the model .* has a unet"))
    for path, error, match in cases:
        cfg = compose_cfg(dpo_overrides(tmp_path, "tiny_sd") + [f"model.init_lora={path}"])
        with pytest.raises(error, match=match):
            adopt_init_lora(cfg)


@pytest.mark.slow
def test_resume_wins_over_init_lora(tmp_path, loras):
    """A resumed run continues its checkpoint (bit for bit as an uninterrupted run) and ignores model.init_lora — here
    a path that no longer exists — saying so; its adapter settings come from the checkpoint."""
    from diffalign.train.preference import train

    init = tmp_path / "init.safetensors"
    shutil.copy(loras["tiny_sd"]["kohya"], init)
    full = train(compose_cfg(dpo_overrides(tmp_path / "full", "tiny_sd", steps=2) + [f"model.init_lora={init}"]))
    train(compose_cfg(dpo_overrides(tmp_path / "cut", "tiny_sd", steps=1) + [f"model.init_lora={init}"]))
    init.unlink()
    cfg = compose_cfg(dpo_overrides(tmp_path / "cut", "tiny_sd", steps=2) + [f"model.init_lora={init}",
                                                                            "resume=latest"])
    logged = []
    policy = build_policy(cfg, log=logged.append)
    assert "is not loaded: the run resumes from" in logged[0] and "checkpoint-1" in logged[0]
    assert policy.denoiser.peft_config["default"].r == 4  # from the checkpoint
    resumed = train(cfg)
    full_lora = read_lora(tmp_path / "full" / "final").state
    assert all(torch.equal(read_lora(tmp_path / "cut" / "final").state[k], v) for k, v in full_lora.items())
    assert resumed["history_tail"][-1]["loss"] == full["history_tail"][-1]["loss"]


@pytest.mark.slow
def test_cli_names_an_explicit_conflict_before_the_model_loads(tmp_path, loras, monkeypatch, capsys,
                                                               release_run_locks):
    """The command line's model.lora_rank=16 against a rank-4 file: refused with both named, before the model (here a
    folder that does not exist, which would fail as soon as it loaded) is touched."""
    from diffalign import cli

    args = [*dpo_overrides(tmp_path / "run", "tiny_sd"), f"model.init_lora={loras['tiny_sd']['kohya']}",
            "model.lora_rank=16", "model.pretrained_model_name_or_path=/does/not/exist"]
    proc = run_cli_in_process(cli.train, args, tmp_path, monkeypatch, capsys)
    assert proc.returncode == 1
    assert ("diffalign: error: model.lora_rank=16 (set on the command line) conflicts with model.init_lora="
            in proc.stderr) and "which has rank 4" in proc.stderr
    assert "does not exist" not in proc.stderr and "Traceback" not in proc.stderr


def test_eval_of_a_transformer_lora_on_a_unet_model_names_the_model_before_loading(tmp_path, loras, monkeypatch):
    """``diffalign-eval checkpoint=<an SD3 run's final>`` without ``model=tiny_sd3`` ran into peft's
    NoMatchingPeftModuleError inside Hydra's "Error in call to target"; now it is refused before any model loads,
    naming the checkpoint, both denoisers and the model to pass (the default eval model is the tiny SD one)."""
    import diffusers

    from diffalign.cli import _eval_main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained", no_loading)
    cfg = compose_cfg([f"checkpoint={loras['tiny_sd3']['folder']}", f"output_dir={tmp_path / 'ev'}"], name="evaluate")
    with pytest.raises(SystemExit, match=r"checkpoint: .* is a LoRA for a transformer, but the model .* has a unet; "
                                         r".*model=tiny_sd3"):
        _eval_main(cfg)
    assert not (tmp_path / "ev" / "samples.jsonl").exists()


def _fake_run(root, lora_folder, model: str):
    """A run folder as diffalign-train leaves it: ``final/`` with the LoRA and the composed config in ``.hydra/``."""
    from omegaconf import OmegaConf

    shutil.copytree(lora_folder, root / "final")
    (root / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_cfg([f"output_dir={root}", f"model={model}"]), root / ".hydra" / "config.yaml")
    return root / "final"


def test_eval_takes_the_model_from_the_runs_config(tmp_path, loras, monkeypatch):
    """``diffalign-eval checkpoints=[base,<an SD3 run>/final]`` without ``model=tiny_sd3`` evaluates on the run's
    model (the default eval model is the tiny SD one, which the test above shows refusing this LoRA), for real: the
    run's saved config carries ``model.init_lora: null``, which the policy constructors do not take. ``model.<key>=``
    overrides apply on top of it, ``model=...`` replaces it, and runs of different models are refused, naming both."""
    from diffalign import cli

    sd3_final = _fake_run(tmp_path / "sd3run", loras["tiny_sd3"]["folder"], "tiny_sd3")
    assert "init_lora" in (tmp_path / "sd3run" / ".hydra" / "config.yaml").read_text()
    tiny = ["eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=2", "report=false"]
    cfg = compose_cfg([f"checkpoints=[base,{sd3_final}]", f"output_dir={tmp_path / 'ev'}", *tiny], name="evaluate")
    assert cfg.model._target_.endswith("StableDiffusionPolicy.from_pretrained")
    cli._eval_main(cfg)  # a real evaluation
    state = json.loads((tmp_path / "ev" / "eval_state.json").read_text())
    assert state["key"]["context"]["model"]["_target_"] == "diffalign.models.sd3.StableDiffusion3Policy.from_pretrained"
    assert state["key"]["context"]["model"]["lora_rank"] == 4  # (then the file's LoRA settings)
    assert len((tmp_path / "ev" / "samples.jsonl").read_text().splitlines()) == 2 * 6  # base + LoRA, 6 prompts

    seen = {}
    monkeypatch.setattr(cli, "_evaluate", lambda cfg, variants: seen.update(model=cfg.model))
    monkeypatch.setattr(cli, "_command_line_overrides", lambda: ["model.torch_dtype=float64"])
    cfg = compose_cfg([f"checkpoints=[base,{sd3_final}]", f"output_dir={tmp_path / 'ev1'}",
                       "model.torch_dtype=float64"], name="evaluate")
    cli._eval_main(cfg)
    assert seen["model"]._target_.endswith("StableDiffusion3Policy.from_pretrained")
    assert seen["model"].torch_dtype == "float64" and "init_lora" not in seen["model"]

    monkeypatch.setattr(cli, "_command_line_overrides", lambda: ["model=tiny_sd"])  # explicit: the family check
    cfg = compose_cfg([f"checkpoints=[base,{sd3_final}]", f"output_dir={tmp_path / 'ev2'}"], name="evaluate")
    with pytest.raises(SystemExit, match=r"is a LoRA for a transformer, but the model .* has a unet"):
        cli._eval_main(cfg)

    monkeypatch.setattr(cli, "_command_line_overrides", list)
    sd_final = _fake_run(tmp_path / "sdrun", loras["tiny_sd"]["folder"], "tiny_sd")
    cfg = compose_cfg([f"checkpoints=[base,{sd3_final},{sd_final}]", f"output_dir={tmp_path / 'ev3'}"],
                      name="evaluate")
    with pytest.raises(SystemExit, match=r"runs that trained different models .*StableDiffusion3Policy.*"
                                         r"assets/tiny_sd3.*StableDiffusionPolicy.*assets/tiny_sd\)"):
        cli._eval_main(cfg)


def test_a_resume_without_the_runs_model_or_lora_settings_is_refused_before_the_model_loads(tmp_path, loras,
                                                                                          monkeypatch):
    """``diffalign-train output_dir=runs/x resume=latest`` for a run started with another recipe: before, the model
    loaded and the optimizer's state failed to load ("loaded state dict contains a parameter group that doesn't
    match", a Hydra error report). Now `check_run` names the checkpoint, the mismatch and the run's overrides file."""
    import diffusers

    from diffalign.train.prepare import check_run

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained", no_loading)
    run = tmp_path / "run"
    overrides_file = str(run / ".hydra" / "overrides.yaml")
    family = (r"^resume=latest: .*checkpoint-3/pytorch_lora_weights.safetensors is a LoRA for a transformer, but the "
              r"model .* has a unet; .*; to continue that run, resume with the overrides the run was started with "
              r"\(recipe=..., model=...: ")
    rank = (r"^resume=latest: the checkpoint .*checkpoint-3 was trained with lora_rank=4, the config builds "
            r"model.lora_rank=8; resume with the overrides")
    for name, match in (("tiny_sd3", family), ("tiny_sd", rank)):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(loras[name]["folder"], run / "checkpoint-3")
        with pytest.raises(ValueError, match=match) as refused:
            check_run(compose_cfg(dpo_overrides(run, "tiny_sd") + ["resume=latest"]))
        assert str(refused.value).endswith(overrides_file + ")")
    same = ["model.lora_rank=4", "model.lora_alpha=2", "+model.lora_target_modules=[to_q,to_k,to_v,to_out.0,conv1]"]
    with pytest.raises(ValueError, match="adapts modules model.lora_target_modules=.* misses, e.g. .*conv1"):
        check_run(compose_cfg(dpo_overrides(run, "tiny_sd") + ["resume=latest", *same[:2],
                                                                "+model.lora_target_modules=[to_q,to_k,to_v,to_out.0]"]))
    check_run(compose_cfg(dpo_overrides(run, "tiny_sd") + ["resume=latest", *same]))  # the run's own settings
    check_run(compose_cfg(dpo_overrides(run, "tiny_sd") + ["resume=latest", f"model.init_lora={run / 'checkpoint-3'}"]))
    check_run(compose_cfg(dpo_overrides(tmp_path / "new", "tiny_sd") + ["resume=latest"]))  # nothing to resume yet
