"""Config mistakes Hydra finds while composing (a typo, a wrong type, an unknown option, a key the selected option
lacks) get one line ``diffalign: error: ...`` naming the key or option, the closest real ones and the fix, before any
work (`diffalign.config.composition`, `diffalign.cli.check_composition`); a config that composes is left to
``hydra.main``. Plus the documented commands of the fresh-user test that failed in composition: another sampler for
the on-policy data (``sampler@data.sampler=dpm_ode``), another sampler for DDPO, and a plugin's sampler."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import compose_cfg
from plugin_helpers import add_entry_points, fake_distribution, isolated_config_groups  # noqa: F401

from diffalign import cli
from diffalign.config.checks import ConfigError
from diffalign.config.compose import setup_hydra
from diffalign.config.composition import run_overrides


def refusal(argv: list[str], config_name: str = "train") -> str:
    """The one line `check_composition` refuses `argv` with (the test fails when it composes)."""
    setup_hydra()
    with pytest.raises(ConfigError) as refused:
        cli.check_composition(config_name, argv)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


# each case: the command line, then the parts of the one line (key, closest real ones, the fix)
CASES = {
    "typo of a key": (["trainer.max_step=2"], [
        ("trainer.max_step is not a setting of trainer (TrainerConfig); did you mean trainer.max_steps? "
         "pass trainer.max_steps=2 (a + would add a key the run refuses). Its settings: "), "max_steps"]),
    "wrong type": (["trainer.max_steps=two"], [
        ("trainer.max_steps=two: trainer.max_steps must be an integer, got 'two' (TrainerConfig.max_steps: int); "
         "pass e.g. trainer.max_steps=")]),
    "a number for a list": (["eval.seeds=3"], [
        "eval.seeds=3: eval.seeds must be a list of integers, got '3'", "; pass e.g. eval.seeds=[3]"]),
    "unknown recipe": (["recipe=tiny_dpoo"], [
        "recipe=tiny_dpoo is not an option of recipe; did you mean tiny_dpo", "? pass recipe=tiny_dpo (the options: ",
        "tiny_flow_grpo"]),
    "unknown method": (["method=diffusion-dpo"], [
        "method=diffusion-dpo is not an option of method; did you mean diffusion_dpo",
        "? pass method=diffusion_dpo (the options: "]),
    "unknown sampler of a nested node": (["sampler@eval.sampler=dpm"], [
        "sampler@eval.sampler=dpm is not an option of sampler; did you mean dpm_ode", "pass sampler@eval.sampler="]),
    "a key another method has": (["recipe=tiny_flow_grpo", "method.beta=0.1"], [
        "method.beta is not a setting of method=flow_grpo (FlowGRPOConfig); did you mean method.beta_kl",
        "pass method.beta_kl=0.1"]),
    # docs/guides/samplers.md promises this line: a flow SDE's noise is noise_level, never eta
    "DDIM's eta on a flow SDE": (["recipe=tiny_flow_grpo", "sampler.eta=0.5"], [
        ("sampler.eta is not a field of sampler=flow_sde (FlowSDESampler) (it samples rectified-flow models; its "
         "noise is sampler.noise_level; eta belongs to sampler=ddim (eps/v-prediction models)); did you mean "
         "sampler.noise_level? pass sampler.noise_level=0.5"), "Its fields: "]),
    "a field of a nested sampler node": (["eval.sampler.eta=0.5"], [
        "eval.sampler.eta is not a field of sampler@eval.sampler=ode (PipelineODESampler)",
        "eta belongs to sampler=ddim"]),
    # a config file (not the command line) sets a field the option selected on the command line lacks
    "a recipe's field the new sampler lacks": (["recipe=tiny_seppo", "sampler=flow_sde"], [
        "configs/recipe/tiny_seppo.yaml sets sampler.eta, which is not a field of sampler=flow_sde (FlowSDESampler)",
        "eta belongs to sampler=ddim", "select the option it was written for"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_composition_error_is_one_line_naming_the_key_and_the_fix(case):
    argv, parts = CASES[case]
    message = refusal(argv)
    for part in parts:
        assert part in message, (part, message)


def test_diffalign_eval_gets_the_same_line():
    message = refusal(["eval.seeds=3"], "evaluate")
    assert message.startswith("eval.seeds=3: eval.seeds must be a list of integers, got '3'"), message
    message = refusal(["checkpont=runs/x/final"], "evaluate")
    assert message.startswith("checkpont is not a setting of evaluate.yaml"), message
    assert "did you mean checkpoint, checkpoints? pass checkpoint=runs/x/final" in message, message


def test_the_command_exits_with_the_line_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["diffalign-train", "trainer.max_step=2"])
    monkeypatch.setattr(cli, "_train_main", lambda cfg: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as stopped:
        cli.train()
    assert str(stopped.value.code).startswith("diffalign: error: trainer.max_step is not a setting of trainer "
                                              "(TrainerConfig); did you mean trainer.max_steps?")
    assert "To append to your config" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["recipe=tiny_dpo"], ["recipe=tiny_flow_grpo", "sampler.noise_level=0.5"], ["--cfg", "job", "trainer.max_steps=2"],
    ["hydra.run.dir=/tmp/x", "trainer.max_steps=2"],
    # an error this check cannot name is left to Hydra (here: a sweep without -m), not swallowed
    ["trainer.max_steps=1,2"],
])
def test_what_composes_or_is_not_named_is_left_to_hydra(argv):
    setup_hydra()
    cli.check_composition("train", argv)  # (no ConfigError)


def test_help_sweeps_and_hydra_full_error_are_left_to_hydra(monkeypatch):
    assert run_overrides(["--cfg", "job", "trainer.max_step=2"]) == ["trainer.max_step=2"]
    for argv in (["--help"], ["--hydra-help"], ["-m", "trainer.max_step=1,2"], ["--info"],
                 ["--config-name", "evaluate", "x=1"]):
        assert run_overrides(argv) is None, argv
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # the user asks for Hydra's own error
    assert run_overrides(["trainer.max_step=2"]) is None
    setup_hydra()
    cli.check_composition("train", ["trainer.max_step=2"])


def test_another_sampler_for_the_on_policy_data_composes():
    """docs/guides/samplers.md: ``recipe=tiny_dpo sampler@data.sampler=dpm_ode`` (it failed with "Key 'eta' not in
    'DPMSolverSampler'": data/failure_pairs.yaml set DDIM's eta)."""
    setup_hydra()
    cli.check_composition("train", ["recipe=tiny_dpo", "sampler@data.sampler=dpm_ode"])
    cfg = compose_cfg(["recipe=tiny_dpo", "sampler@data.sampler=dpm_ode"])
    assert (cfg.data.sampler.name, cfg.data.sampler.num_inference_steps) == ("dpm_ode", 10)


def test_the_main_jobs_data_sampler_is_ddim_with_eta_0_image_for_image(tiny_policy):
    """The data's sampler is now ``ode`` (no eta to refuse when another option replaces it); on an eps model it must
    sample the images DDIM with eta 0 sampled before, bit for bit (the main job's data unchanged)."""
    from diffalign.samplers.base import build_sampler
    from diffalign.samplers.rollout import rollout

    node = compose_cfg(["recipe=tiny_dpo"]).data.sampler
    assert (node.name, node.num_inference_steps, node.guidance_scale) == ("ode", 10, 4.0)
    before = build_sampler({"name": "ddim", "num_inference_steps": 10, "guidance_scale": 4.0, "eta": 0.0})
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    images = [rollout(tiny_policy, prompts, build_sampler(s), generator=[torch.Generator().manual_seed(s_) for s_ in
                                                                           (3, 1, 4)]).images
              for s in (node, before)]
    assert torch.equal(*images)


def test_ddpo_with_a_flow_sampler_names_the_family_mismatch(tmp_path):
    """``recipe=tiny_ddpo sampler=flow_sde`` composed into "Key 'eta' not in 'FlowSDESampler'" (the recipe set
    DDIM's eta); it now composes and the run's check names the family."""
    from diffalign.train.prepare import check_run

    assert (compose_cfg(["recipe=tiny_ddpo"]).sampler.eta, compose_cfg(["recipe=tiny_ddpo"]).sampler.num_inference_steps
            ) == (1.0, 20)  # (the recipe's rollouts: ddim's defaults, unchanged)
    setup_hydra()
    cli.check_composition("train", ["recipe=tiny_ddpo", "sampler=flow_sde"])
    overrides = ["recipe=tiny_ddpo", "sampler=flow_sde", f"output_dir={tmp_path}", "trainer.log_with=none"]
    with pytest.raises(ValueError) as refused:
        check_run(compose_cfg(overrides), overrides)
    assert "the sampler steps rectified-flow models (sampler.model_family=flow" in str(refused.value)
    assert "is an eps/v-prediction model" in str(refused.value)


PLUGIN_SAMPLER = '''
from dataclasses import dataclass

from diffalign.samplers.base import register_sampler
from diffalign.samplers.ddim_logprob import DDIMSampler


@register_sampler
@dataclass
class HalfEtaSampler(DDIMSampler):
    """A plugin's sampler: DDIM with eta 0.5 by default."""

    name: str = "half_eta_ddim"
    eta: float = 0.5


@dataclass
class PluginMethodConfig:  # the entry point's value: importing it registers the sampler above
    _target_: str = "diffalign.objectives.ddpo.DDPO"
'''


@pytest.fixture
def plugin_sampler(tmp_path, monkeypatch):
    """A module outside the package, loaded as an entry point would load it, registering ``half_eta_ddim``."""
    from hydra.core.config_store import ConfigStore

    from diffalign.config import schemas
    from diffalign.samplers import base

    (tmp_path / "diffalign_test_sampler_plugin.py").write_text(PLUGIN_SAMPLER)
    monkeypatch.syspath_prepend(str(tmp_path))
    dist = fake_distribution(tmp_path, "sampler-plugin",
                             "[diffalign.methods]\nplugin_method = diffalign_test_sampler_plugin:PluginMethodConfig\n")
    add_entry_points(monkeypatch, dist)
    yield "half_eta_ddim"
    base.SAMPLERS.pop("half_eta_ddim", None)
    schemas._REGISTRY.get("sampler", {}).pop("half_eta_ddim", None)
    repo = ConfigStore.instance().repo
    repo.get("sampler", {}).pop("half_eta_ddim.yaml", None)
    repo.get("schema", {}).get("sampler", {}).pop("half_eta_ddim.yaml", None)
    sys.modules.pop("diffalign_test_sampler_plugin", None)


def test_a_plugins_sampler_is_selected_and_composed(plugin_sampler):
    """docs/guides/samplers.md: a sampler may come from any module imported before the config is composed, e.g. a
    plugin (its schemas were stored before the entry points were loaded, so ``sampler=<plugin's>`` was not found)."""
    from diffalign.samplers.base import build_sampler

    setup_hydra()  # (loads the entry points, then stores the schemas)
    cli.check_composition("train", [f"sampler={plugin_sampler}"])
    cfg = compose_cfg([f"sampler={plugin_sampler}", f"sampler@eval.sampler={plugin_sampler}", "sampler.eta=0.25"])
    assert (cfg.sampler.name, cfg.sampler.eta, cfg.sampler.num_inference_steps) == (plugin_sampler, 0.25, 20)
    assert (cfg.eval.sampler.name, cfg.eval.sampler.eta) == (plugin_sampler, 0.5)
    sampler = build_sampler(cfg.sampler)
    assert type(sampler).__name__ == "HalfEtaSampler" and sampler.eta == 0.25
    assert "is not a field of sampler=half_eta_ddim (HalfEtaSampler)" in refusal([f"sampler={plugin_sampler}",
                                                                                  "sampler.noise_level=1"])
