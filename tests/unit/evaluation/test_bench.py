"""The learning benchmark's bookkeeping (`diffalign.evaluation.bench`): the runs' overrides, the figures read back from
a run folder, and the statistics over seeds, checked by hand on a fabricated run folder."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from diffalign.evaluation.bench import (
    METHODS,
    _image_se,
    crossed_se,
    main,
    markdown,
    read_run,
    run_digest,
    run_overrides,
    summarize,
)


def test_every_method_gets_its_recipe_the_reward_and_a_cheap_evaluation():
    online = run_overrides(METHODS["vipo"], "brightness", 2, quick=False)
    assert online[0] == "recipe=tiny_vipo_image"
    assert "reward=[brightness]" in online and "eval_reward=[brightness,geneval_shapes]" in online
    assert "seed=2" in online and not any(o.startswith("data=") for o in online)
    offline = run_overrides(METHODS["diffusion_dpo"], "brightness", 1, quick=True)
    assert "data=ranked_pairs" in offline and "data.reward=brightness" in offline and "data.seed=1" in offline
    assert "trainer.max_steps=10" in offline  # --quick
    sft = run_overrides(METHODS["sft"], "verifier", 2, quick=False)
    assert sft[:2] == ["recipe=tiny_dpo", "method=sft"] and "data.seed=2" in sft  # the recipe's data, reseeded
    assert METHODS["ddspo"].rewards == ("verifier",)  # reward-free pairs: no easy-reward row
    control = run_overrides(METHODS["diffusion_dpo"], "control", 0, quick=False)  # the same run, random scores
    assert "data.reward=random_control" in control and "eval_reward=[brightness,geneval_shapes]" in control
    assert "reward=[random_control]" in run_overrides(METHODS["ddpo"], "control", 0, quick=False)


def _fake_run(folder, base: float, finetuned: float, curve: list[float], seeds=(0, 1), per_image=None):
    """A run folder as diffalign-train leaves it: results.json, history.jsonl, eval samples (2 prompts x 2 seeds);
    ``per_image`` (optional): {variant: {(prompt, seed): brightness}}, written as each sample's ``brightness``."""
    eval_dir = folder / "eval"
    rows = []
    for variant, value in (("base", base), ("finetuned", finetuned)):
        for p in range(2):
            for s in seeds:
                path = f"images/{variant}/p{p}_s{s}.png"
                (eval_dir / path).parent.mkdir(parents=True, exist_ok=True)
                pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(p * 10 + s)) * 255).byte()
                Image.fromarray(pixels.numpy()).save(eval_dir / path)
                row = {"variant": variant, "prompt_index": p, "seed": s, "image": path}
                if per_image is not None:
                    row["brightness"] = per_image[variant][(p, s)]
                rows.append(row)
    (eval_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"base": {"brightness/mean": base, "geneval_shapes/accuracy": 0.5},
               "finetuned": {"brightness/mean": finetuned, "geneval_shapes/accuracy": 0.25}}
    results = {"total_seconds": 60.0, "train_seconds": 50.0, "rollouts": 640,
               "eval": {"variants": summary, "finetuned_vs_base": {
                   "brightness/mean_gain": {"gain": finetuned - base, "se": 0.01},
                   "geneval_shapes/accuracy_gain": {"gain": -0.25, "se": 0.06}}}}
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "history.jsonl").write_text("".join(json.dumps({"epoch": i + 1, "reward/mean": r}) + "\n"
                                                  for i, r in enumerate(curve)))


class MeanEmbedder:
    """Embeds an image as its mean colour: identical images have distance 0."""

    def embed_images(self, images):
        return images.flatten(2).mean(2) + 1.0


def test_a_run_is_read_back_and_seeds_are_summarised_by_hand(tmp_path):
    _fake_run(tmp_path / "a", 0.1, 0.3, [0.1, 0.1, 0.2, 0.3, 0.4])
    _fake_run(tmp_path / "b", 0.1, 0.2, [0.1, 0.2, 0.2, 0.2, 0.2])
    a = read_run(tmp_path / "a", "brightness", MeanEmbedder())
    assert a["start"] == 0.1 and a["end"] == 0.3 and a["gain"] == pytest.approx(0.2)
    assert a["train_rise"] == pytest.approx(0.3 - 0.1)  # mean(0.2, 0.3, 0.4) - mean(0.1, 0.1)
    assert a["verifier_start"] == 0.5 and a["verifier_end"] == 0.25
    assert a["verifier_change"] == -0.25 and a["verifier_change_se"] == 0.06  # the evaluation's paired figure
    assert a["diversity_start"] == a["diversity_end"] > 0  # the same fake images for both variants
    b = read_run(tmp_path / "b", "brightness", MeanEmbedder())
    (row,) = summarize({("vipo", "brightness"): [a, b]})
    assert row["gain"] == pytest.approx(0.15)
    assert row["gain_se"] == pytest.approx(math.sqrt(((0.05**2) * 2) / 1) / math.sqrt(2))  # stdev/sqrt(n)
    assert row["gain_over_se"] == pytest.approx(0.15 / 0.05)
    table = markdown([row], "diffalign-bench --x")
    assert "| vipo | brightness | 2 | – | 0.100 → 0.250 | 0.150 ± 0.050 (3.0) |" in table
    assert row["verifier_change"] == -0.25 and row["verifier_change_se"] == 0.0  # equal over the two seeds
    (one,) = summarize({("vipo", "brightness"): [a]})  # one seed: the paired s.e. over its images
    assert one["verifier_change_se"] == 0.06 and one["gain_se"] == 0.01
    assert "| 0.500 → 0.250 | -0.250 ± 0.060 |" in markdown([one], "diffalign-bench --x")


def test_the_gain_gets_the_s_e_over_images_and_its_ratio_uses_both_s_e(tmp_path):
    """Two seeds score the same 4 images. Per-image gains (fine-tuned − base), by hand:
    seed a: +0.2, +0.2, +0.0, +0.4 (mean 0.2); seed b: +0.0, +0.2, +0.2, +0.2 (mean 0.15).
    Seed-averaged per image: 0.1, 0.2, 0.1, 0.3 → mean 0.175, stdev √(((−.075)² + .025² + (−.075)² + .125²)/3)
    = √(0.0275/3), s.e. over images = that / 2. S.e. over seeds: |0.2 − 0.15| / 2 = 0.025.
    The crossed s.e.: MS_seed = 4 (0.025² + 0.025²) = 0.005; MS_image = 2 × 0.0275 / 3; residuals g − ḡ_s − ḡ_i + ḡ
    = ±0.075, ∓0.025, ∓0.125, ±0.075 in each seed, so MS_res = 2 × 0.0275 / 3 too; σ̂²_seed = max(0, (0.005 −
    0.0183) / 4) = 0, σ̂²_image = 0, Var = MS_res / 8 = 0.0275 / 12."""
    base = {(0, 0): 0.1, (0, 1): 0.2, (1, 0): 0.3, (1, 1): 0.0}
    ft_a = {(0, 0): 0.3, (0, 1): 0.4, (1, 0): 0.3, (1, 1): 0.4}
    ft_b = {(0, 0): 0.1, (0, 1): 0.4, (1, 0): 0.5, (1, 1): 0.2}
    _fake_run(tmp_path / "a", 0.15, 0.35, [0.1] * 5, per_image={"base": base, "finetuned": ft_a})
    _fake_run(tmp_path / "b", 0.15, 0.30, [0.1] * 5, per_image={"base": base, "finetuned": ft_b})
    a, b = (read_run(tmp_path / n, "brightness", MeanEmbedder()) for n in "ab")
    assert a["image_gains"] == pytest.approx({"p0_s0": 0.2, "p0_s1": 0.2, "p1_s0": 0.0, "p1_s1": 0.4})
    (row,) = summarize({("vipo", "brightness"): [a, b]})
    se_images = math.sqrt(0.0275 / 3) / 2
    assert row["gain"] == pytest.approx(0.175) and row["gain_se"] == pytest.approx(0.025)
    assert row["gain_se_images"] == pytest.approx(se_images)
    assert row["gain_se_combined"] == pytest.approx(math.sqrt(0.0275 / 12))
    assert row["gain_over_se"] == pytest.approx(0.175 / math.sqrt(0.0275 / 12))
    assert f"0.175 ± 0.025, ± {se_images:.3f} images (" in markdown([row], "diffalign-bench --x")
    assert math.isnan(row["verifier_change_se_images"])  # the fake samples carry no per-image verifier field
    (one,) = summarize({("vipo", "brightness"): [a]})  # one seed: its own paired s.e., no images column
    assert math.isnan(one["gain_se_images"]) and one["gain_over_se"] == pytest.approx(0.2 / 0.01)
    c = dict(b, image_gains={"p0_s0": 0.1})  # runs that scored different images: no s.e. over images
    (mixed,) = summarize({("vipo", "brightness"): [a, c]})
    assert math.isnan(mixed["gain_se_images"]) and mixed["gain_over_se"] == pytest.approx(0.175 / 0.025)


def test_crossed_se_by_hand():
    """Seeds (1, 0, 0) and (1, 1, 0): ḡ = 0.5, seed means 1/3, 2/3, image means 1, 0.5, 0. MS_seed = 3 (2/36) = 1/6,
    MS_image = 2 (0.25 + 0 + 0.25) / 2 = 1/2, residuals ±1/6, ∓1/3, ±1/6 → MS_res = (4/36 + 2/9) / 2 = 1/6;
    σ̂²_seed = 0, σ̂²_image = (1/2 − 1/6) / 2 = 1/6; Var = (1/6) / 3 + (1/6) / 6 = 1/12 (the summed squared s.e.
    would give 1/36 + 1/12 = 1/9). Runs that scored other images, or one run: NaN."""
    gains = [{"a": 1.0, "b": 0.0, "c": 0.0}, {"a": 1.0, "b": 1.0, "c": 0.0}]
    assert crossed_se(gains) == pytest.approx(math.sqrt(1 / 12))
    assert math.isnan(crossed_se(gains[:1])) and math.isnan(crossed_se([gains[0], {"a": 1.0, "b": 0.0}]))


def test_crossed_se_matches_the_variance_of_the_mean_that_the_summed_s_e_overstate():
    """3000 tables drawn from g = a_s + b_i + e_si (σ 0.6, 0.3, 1; S = 3, I = 12): the true Var(ḡ) = 0.36/3 + 0.09/12
    + 1/36. The mean squared `crossed_se` is within 6 % of it (it is unbiased but for the truncation at 0, which only
    raises it); the summed squared s.e. over seeds and over images overstate it by σ²_res/(SI) = 0.028 in expectation."""
    rng = np.random.default_rng(0)
    n_s, n_i, sd_seed, sd_image, sd_res = 3, 12, 0.6, 0.3, 1.0
    true = sd_seed**2 / n_s + sd_image**2 / n_i + sd_res**2 / (n_s * n_i)
    crossed, summed = [], []
    for _ in range(3000):
        g = rng.normal(0, sd_seed, (n_s, 1)) + rng.normal(0, sd_image, (1, n_i)) + rng.normal(0, sd_res, (n_s, n_i))
        gains = [{str(i): float(g[s, i]) for i in range(n_i)} for s in range(n_s)]
        crossed.append(crossed_se(gains) ** 2)
        summed.append(np.var(g.mean(1), ddof=1) / n_s + _image_se(gains) ** 2)
    assert np.mean(crossed) == pytest.approx(true, rel=0.06)
    assert np.mean(summed) > 1.12 * true


def test_list_prints_the_runs_without_running_them(capsys):
    assert main(["--list", "--methods", "ddpo", "ddspo", "--rewards", "brightness", "--seeds", "0", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["ddpo-brightness-s0", "ddpo-brightness-s1"]  # no DDSPO row
    assert main(["--list", "--methods", "ddpo", "--seeds", "0"]) == 0  # the control runs only when asked for
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [
        "ddpo-brightness-s0", "ddpo-verifier-s0"]
    # a Hydra override may follow any option (it is not taken as one of --seeds' values); duplicate seeds run once
    assert main(["--list", "--methods", "ddpo", "--rewards", "brightness", "--seeds", "0", "0",
                 "trainer.optimizer.lr=5e-3"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("trainer.optimizer.lr=5e-3")


def _composed(name: str, tmp_path, reward: str = "brightness") -> dict:
    """The benchmark's `reward` run of entry `name`, seed 0, composed and checked as ``diffalign-train`` would."""
    from conftest import compose_cfg
    from omegaconf import OmegaConf

    from diffalign.train.prepare import check_run

    overrides = run_overrides(METHODS[name], reward, 0, quick=False)
    cfg = compose_cfg([*overrides, f"output_dir={tmp_path}"])
    check_run(cfg, overrides)
    return OmegaConf.to_container(cfg, resolve=False)


def _differences(a: dict, b: dict, prefix: str = "") -> set[str]:
    """The dotted keys whose values differ between two nested config dicts."""
    keys = set(a) | set(b)
    out = set()
    for k in keys:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.add(f"{prefix}{k}")
    return out


def test_the_sampler_guard_and_flux_rows_change_only_what_they_name_against_flow_grpo(tmp_path):
    """Each new row is the Flow-GRPO row with one thing changed, so its figures compare that thing alone: the CPS row
    its sampler, the windowed row its sampler (at the recipe's 10 steps), the Guard row its method (RatioNorm and the
    1/Δt reweighting, the rest of the method equal), the FLUX row its model; all compose and pass ``check_run``."""
    from diffalign.samplers.base import build_sampler
    from diffalign.samplers.cps import CPSSampler
    from diffalign.samplers.window_sde import WindowSDESampler

    base = _composed("flow_grpo", tmp_path)
    rows = {name: _composed(name, tmp_path) for name in ("flow_grpo_cps", "flow_grpo_window", "grpo_guard",
                                                         "flow_grpo_flux")}
    assert _differences(base, rows["flow_grpo_cps"]) == {"sampler.name", "sampler.noise_level"}
    assert rows["flow_grpo_cps"]["sampler"]["noise_level"] == 0.8  # CPS's released default, Flow-GRPO's `cps` type
    assert _differences(base, rows["flow_grpo_window"]) == {  # its noise_level (0.7), steps and CFG are Flow-GRPO's
        "sampler.name", "sampler.window_size", "sampler.shift_interval", "sampler.window_stride"}
    window = rows["flow_grpo_window"]["sampler"]
    assert (window["num_inference_steps"], window["window_size"], window["shift_interval"]) == (10, 4, 2)
    assert window["num_inference_steps"] == base["sampler"]["num_inference_steps"]  # the same rollout budget
    assert _differences(base, rows["grpo_guard"]) == {"method._target_", "method.ratio_norm", "method.grad_reweight"}
    assert rows["grpo_guard"]["method"]["ratio_norm"] is True
    assert rows["grpo_guard"]["method"]["grad_reweight"] == "inverse_dt"
    for key in ("clip_range", "beta_kl"):
        assert rows["grpo_guard"]["method"][key] == base["method"][key]
    flux = _differences(base, rows["flow_grpo_flux"])
    assert "model._target_" in flux and all(k.startswith("model.") for k in flux)
    assert isinstance(build_sampler(_cfg(rows["flow_grpo_cps"]["sampler"])), CPSSampler)
    assert isinstance(build_sampler(_cfg(window)), WindowSDESampler)


def _cfg(values: dict):
    from omegaconf import OmegaConf

    return OmegaConf.create(values)


@pytest.mark.parametrize("name", ["dgpo", "flow_grpo"])
def test_the_verifier_rows_of_dgpo_and_flow_grpo_run_their_geneval_recipe(name, tmp_path):
    """The verifier rows run `tiny_<method>_geneval`: the brightness row's run with only the base (tiny_sd3_wide), the
    budget (24 epochs x 24 prompts), the learning rate, the KL and the evaluation (the whole held-out split x 32 seeds,
    not the other rows' 33 prompts x 2 seeds) changed; --quick keeps its smoke-test evaluation."""
    overrides = run_overrides(METHODS[name], "verifier", 0, quick=False)
    assert overrides[0] == f"recipe=tiny_{name}_geneval" and "reward=[geneval_shapes]" in overrides
    assert not any(o.startswith(("eval.prompts_per_tag", "eval.seeds")) for o in overrides)
    brightness, verifier = _composed(name, tmp_path), _composed(name, tmp_path, "verifier")
    assert _differences(brightness, verifier) == {
        "model.pretrained_model_name_or_path", "online.num_epochs", "online.groups_per_epoch",
        "online.checkpointing_epochs", "method.beta_kl", "trainer.optimizer.lr", "eval.prompts_per_tag", "eval.seeds",
        "reward.brightness", "reward.geneval_shapes", "eval_reward.brightness"}  # the rows' rewards
    assert verifier["model"]["pretrained_model_name_or_path"] == "${diffalign_asset:tiny_sd3_wide}"
    assert (verifier["online"]["num_epochs"], verifier["online"]["groups_per_epoch"]) == (24, 24)
    assert (verifier["method"]["beta_kl"], verifier["trainer"]["optimizer"]["lr"]) == (0.2, 3e-3)
    assert verifier["eval"]["prompts_per_tag"] is None and verifier["eval"]["seeds"] == list(range(32))
    quick = run_overrides(METHODS[name], "verifier", 0, quick=True)
    assert "eval.prompts_per_tag=2" in quick and "online.num_epochs=3" in quick


@pytest.mark.parametrize("name", ["flow_grpo", "dgpo"])
def test_the_flux_rows_are_the_sd3_rows_on_the_flux_models(name, tmp_path):
    """`<method>_flux`'s rows are `<method>`'s with only the model changed: on brightness to `tiny_flux`, on the
    verifier (`tiny_<method>_flux_geneval`: the SD3 GenEval recipe's budget, learning rate, KL and 32-seed
    evaluation) to the stronger FLUX base `tiny_flux_wide`."""
    overrides = run_overrides(METHODS[f"{name}_flux"], "verifier", 0, quick=False)
    assert overrides[0] == f"recipe=tiny_{name}_flux_geneval"
    for reward, asset in (("brightness", "tiny_flux"), ("verifier", "tiny_flux_wide")):
        sd3, flux = _composed(name, tmp_path, reward), _composed(f"{name}_flux", tmp_path, reward)
        changed = _differences(sd3, flux)
        assert "model._target_" in changed and all(k.startswith("model.") for k in changed)
        assert flux["model"]["pretrained_model_name_or_path"] == f"${{diffalign_asset:{asset}}}"
        assert flux["model"]["_target_"] == "diffalign.models.flux.FluxPolicy.from_pretrained"


def test_the_table_counts_each_rows_images(tmp_path):
    per_image = {v: {(p, s): 0.5 for p in range(2) for s in range(2)} for v in ("base", "finetuned")}
    _fake_run(tmp_path / "a", 0.4, 0.5, [0.4, 0.5], per_image=per_image)
    row = summarize({("dgpo", "brightness"): [read_run(tmp_path / "a", "brightness", MeanEmbedder())]})[0]
    assert row["images"] == 4  # 2 prompts x 2 seeds, each scored base and fine-tuned
    assert "| dgpo | brightness | 1 | 4 |" in markdown([row], "cmd")


def test_a_run_folder_is_named_by_its_composed_settings_so_an_edited_recipe_never_reuses_a_finished_run(
        tmp_path, monkeypatch):
    """The folder hash follows what the run trains: an override equal to the recipe's own value keeps the folder,
    ``output_dir`` does not enter it, another value changes it, and so does the same value written into a copy of the
    recipe file (with the overrides unchanged, the old hash of the overrides alone kept the stale folder)."""
    import shutil

    from diffalign.config import compose

    args = run_overrides(METHODS["dgpo"], "verifier", 0, quick=False)
    digest = run_digest(args)
    assert len(digest) == 8 and int(digest, 16) >= 0
    assert run_digest([*args, "online.num_epochs=24"]) == digest  # the recipe's own value
    assert run_digest([*args, f"output_dir={tmp_path}"]) == digest
    longer = run_digest([*args, "online.num_epochs=48"])
    assert longer != digest
    edited = tmp_path / "configs"
    shutil.copytree(compose.CONFIG_DIR, edited)
    recipe = edited / "recipe" / "tiny_dgpo_geneval.yaml"
    text = recipe.read_text()
    assert "  num_epochs: 24\n" in text
    recipe.write_text(text.replace("  num_epochs: 24\n", "  num_epochs: 48\n"))
    monkeypatch.setattr(compose, "CONFIG_DIR", str(edited))
    assert run_digest(args) == longer


def test_an_override_that_does_not_compose_is_one_line_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--methods", "dgpo", "--rewards", "brightness", "--seeds", "0", "--out", str(tmp_path),
              "online.num_epochz=3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "dgpo-brightness-s0" in err and "online.num_epochz" in err and "num_epochs" in err
    assert not any((tmp_path / "runs").iterdir())  # nothing ran
