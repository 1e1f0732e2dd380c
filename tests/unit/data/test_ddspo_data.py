"""DDSPO data: prompt degradation (deterministic, 40–70 % of words, never the original or empty), the attribute rules,
the external-rewriter interface, offline pair generation (same seed for x^w and x^l, resumable shards) and the data set
in the preference loop."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from safetensors.torch import load_file

from diffalign.data.ddspo_pairs import DDSPOPairs, DDSPOPairsConfig, generate_pairs, plan_pairs
from diffalign.data.degrade import (
    attribute_degradation,
    attribute_edits,
    degrade_prompt,
    load_rewriter,
    random_word_removal,
    removal_range,
)
from diffalign.world.prompts import load_prompts

PROMPTS = [
    "a red circle left of a green triangle",
    "two blue squares",
    "a photo of a cat sitting on a wooden bench next to a red bicycle",
    "three yellow triangles",
    "a circle",
]

# --------------------------------------------------------------------------------------------- random word removal


@pytest.mark.parametrize("prompt", PROMPTS + [row["prompt"] for row in load_prompts("train")[::37]])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_removal_is_deterministic_and_removes_40_to_70_percent(prompt, seed):
    variants = random_word_removal(prompt, seed=seed)
    assert variants == random_word_removal(prompt, seed=seed)
    n = len(prompt.split())
    assert 1 <= len(variants) <= 5 and len(set(variants)) == len(variants)
    for variant in variants:
        assert variant and variant.strip() and variant != prompt
        removed = n - len(variant.split())
        assert 0.4 <= removed / n <= 0.7, (variant, removed, n)
        remaining = prompt.split()
        for word in variant.split():  # an order-preserving sub-sequence of the original words
            remaining = remaining[remaining.index(word) + 1:]


def test_random_removal_varies_with_seed_and_finds_up_to_five_variants():
    long_prompt = PROMPTS[2]
    assert random_word_removal(long_prompt, seed=0) != random_word_removal(long_prompt, seed=1)
    assert len(random_word_removal(long_prompt, seed=0)) == 5
    assert len(random_word_removal("a circle", seed=0)) == 2  # only "a" and "circle" exist
    assert len(random_word_removal(long_prompt, seed=0, num_variants=2)) == 2


def test_removal_range_is_exact():
    assert removal_range(15) == (6, 10)  # 0.4 · 15 = 6 exactly (not 6.000000000000001 → 7)
    assert removal_range(10) == (4, 7)
    assert removal_range(3) == (2, 2)
    assert removal_range(2) == (1, 1)


def test_one_word_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="1 word.*degradation=attributes"):
        random_word_removal("circle")
    with pytest.raises(ValueError, match="word"):
        degrade_prompt("   circle ")
    assert attribute_degradation("circle", seed=0)  # the documented alternative: a swapped shape
    jobs, skipped = plan_pairs([{"prompt": "circle"}, {"prompt": "a circle"}])
    assert skipped == ["circle"] and [j["prompt"] for j in jobs] == ["a circle"]


# ------------------------------------------------------------------------------------------------ attribute rules


def test_attribute_rules_on_the_tiny_world_vocabulary():
    prompt = "a red circle left of a green triangle"
    edits = {(kind, op, prompt[:s] + r + prompt[e:]) for kind, op, s, e, r in attribute_edits(prompt)}
    norm = {(k, o, " ".join(p.split())) for k, o, p in edits}
    assert ("color", "remove", "a circle left of a green triangle") in norm
    assert ("color", "swap", "a blue circle left of a green triangle") in norm
    assert ("shape", "swap", "a red square left of a green triangle") in norm
    assert ("shape", "remove", "a red object left of a green triangle") in norm
    assert ("relation", "swap", "a red circle right of a green triangle") in norm
    assert ("relation", "remove", "a red circle and a green triangle") in norm
    # swaps stay inside the tiny world's colours and shapes when the original word is one of them
    assert not any("purple" in p or "hexagon" in p for _, _, p in norm)
    assert not any(k == "count" for k, _, _ in norm)

    def counts(text):
        return {" ".join((text[:s] + r + text[e:]).split()) for k, _, s, e, r in attribute_edits(text) if k == "count"}

    assert counts("two blue squares") == {"blue squares", "three blue squares"}  # the world's counts are 2 and 3
    assert counts("Five cats") == {"cats", *(f"{n.capitalize()} cats" for n in ("two", "three", "four", "six", "seven",
                                                                                 "eight", "nine", "ten"))}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_attribute_degradation_is_deterministic_and_never_the_original(prompt):
    variants = attribute_degradation(prompt, seed=3)
    assert variants == attribute_degradation(prompt, seed=3)
    assert variants and all(v and v != prompt for v in variants) and len(set(variants)) == len(variants)


def test_attribute_degradation_falls_back_to_word_removal_without_attribute_words():
    prompt = "a photo of a cat sitting on a bench"
    assert attribute_edits(prompt) == []
    assert attribute_degradation(prompt, seed=0) == random_word_removal(prompt, seed=0)


# ------------------------------------------------------------------------------------------------ external rewriter


class ShoutingRewriter:
    """A stand-in for an LLM rewriter: deterministic, no network."""

    def __call__(self, prompt, num_variants, seed):
        return [prompt, "", f"  {prompt.upper()}  ", f"{prompt.upper()}", f"seed {seed}"]


def make_rewriter():
    return ShoutingRewriter()


def test_external_rewriter_is_off_by_default_and_sanitised():
    with pytest.raises(ValueError, match="needs a rewriter"):
        degrade_prompt("a red circle", "external")
    rewriter = load_rewriter(f"{__name__}:make_rewriter")
    assert degrade_prompt("a red circle", "external", seed=7, rewriter=rewriter) == ["A RED CIRCLE", "seed 7"]
    with pytest.raises(ValueError, match="no usable"):
        degrade_prompt("a", "external", rewriter=lambda p, n, s: ["a", " "])
    with pytest.raises(ValueError, match="package.module:factory"):
        load_rewriter("no_colon")
    with pytest.raises(ValueError, match="cannot be imported"):
        load_rewriter("diffalign.nonexistent_module:factory")
    with pytest.raises(ValueError, match="must be one of"):
        degrade_prompt("a red circle", "llm")


# ------------------------------------------------------------------------------------------------ pair generation

ROWS = [{"prompt": p, "tag": "t"} for p in ["a red circle", "two blue squares", "a green triangle above a red square",
                                           "circle", "three yellow circles"]]


@pytest.fixture(scope="module")
def pipeline():
    from diffalign.models.tiny_random import build_tiny_random_pipeline

    return build_tiny_random_pipeline(seed=0)


def generate(pipeline, out, **kwargs):
    settings = {"num_inference_steps": 2, "guidance_scale": 3.0, "scheduler": "ddim", "seed": 5, "shard_size": 2,
                "batch_size": 3, "progress": False, **kwargs}
    return generate_pairs(pipeline, ROWS, out, **settings)


def test_pairs_share_the_seed_and_are_stored_as_latents(tmp_path, pipeline):
    stats = generate(pipeline, tmp_path)
    assert stats == {"num_pairs": 4, "num_shards": 2, "generated_shards": 2, "skipped_prompts": 1}  # "circle" skipped
    rows = [json.loads(line) for line in (tmp_path / "shard-00000.jsonl").read_text().splitlines()]
    tensors = load_file(tmp_path / "shard-00000.safetensors")
    assert tensors["latents_w"].shape == (2, 4, 8, 8) and tensors["latents_l"].dtype == torch.float32
    for k, row in enumerate(rows):
        assert row["degraded_prompt"] in row["degraded_prompts"] and row["degraded_prompt"] != row["prompt"]
        for key, prompt in (("latents_w", row["prompt"]), ("latents_l", row["degraded_prompt"])):
            again = pipeline(prompt=[prompt], num_inference_steps=2, guidance_scale=3.0, output_type="latent",
                             generator=[torch.Generator().manual_seed(row["seed"])]).images
            torch.testing.assert_close(tensors[key][k:k + 1], again, atol=1e-5, rtol=1e-5)
    # same seed, different prompt: the pair shares its initial noise, so x^w and x^l differ only through c vs c⁻
    assert not torch.allclose(tensors["latents_w"][0], tensors["latents_l"][0])


def test_generation_resumes_and_refuses_other_settings(tmp_path, pipeline):
    generate(pipeline, tmp_path)
    first = load_file(tmp_path / "shard-00001.safetensors")
    (tmp_path / "shard-00001.jsonl").unlink()  # as if interrupted before shard 1 was finished
    mtime0 = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    stats = generate(pipeline, tmp_path)
    assert stats["generated_shards"] == 1
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == mtime0  # finished shard skipped
    again = load_file(tmp_path / "shard-00001.safetensors")
    for key in first:
        assert torch.equal(first[key], again[key])
    with pytest.raises(ValueError, match="guidance_scale"):
        generate(pipeline, tmp_path, guidance_scale=7.5)
    assert generate(pipeline, tmp_path, source="/moved/checkout/tiny_sd")["generated_shards"] == 0  # a path only warns


def test_a_stop_signal_ends_the_generation_after_a_shard_and_it_resumes(tmp_path, pipeline):
    def stop_after_first(done, total, folder):
        if done == 1:
            raise KeyboardInterrupt(f"{done}/{total} in {folder}")

    with pytest.raises(KeyboardInterrupt, match=f"^1/2 in {tmp_path}$"):
        generate(pipeline, tmp_path, after_shard=stop_after_first)
    assert (tmp_path / "shard-00000.jsonl").is_file() and not (tmp_path / "shard-00001.jsonl").exists()
    assert generate(pipeline, tmp_path, after_shard=stop_after_first)["generated_shards"] == 1
    generate(pipeline, tmp_path / "ref")
    for k in range(2):
        a, b = load_file(tmp_path / f"shard-0000{k}.safetensors"), load_file(tmp_path / "ref" / f"shard-0000{k}.safetensors")
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_data_set_collates_latents_and_degraded_prompts(tmp_path, pipeline):
    generate(pipeline, tmp_path)
    data = DDSPOPairs(str(tmp_path))
    assert len(data) == 4
    batch = data.collate([3, 0])
    tensors = load_file(tmp_path / "shard-00001.safetensors")
    assert torch.equal(batch["latents_w"][0], tensors["latents_w"][1])
    assert batch["ids"].tolist() == [3, 0] and batch["prompts"][1] == "a red circle"
    assert batch["degraded_prompts"][0] != batch["prompts"][0]
    assert len(DDSPOPairs(str(tmp_path), max_pairs=3)) == 3
    with pytest.raises(FileNotFoundError, match="data.pairs_dir"):
        DDSPOPairs(str(tmp_path / "missing"))
    assert set(vars(DDSPOPairsConfig())) - {"_target_"} == set(inspect.signature(DDSPOPairs).parameters)


def test_command_writes_a_folder(tmp_path):
    from diffalign.data.ddspo_pairs import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    main(["--out", str(tmp_path / "pairs"), "--prompts", str(prompts), "--num-inference-steps", "2",
          "--scheduler", "ddim", "--device", "cpu"])
    manifest = json.loads((tmp_path / "pairs" / "manifest.json").read_text())
    assert manifest["num_pairs"] == 2 and manifest["settings"]["guidance_scale"] == 7.5  # the paper's default
    assert len(DDSPOPairs(str(tmp_path / "pairs"))) == 2


# ----------------------------------------------------------------------------------------- in the preference loop


def test_tiny_ddspo_recipe_runs_and_dpo_trains_on_the_same_pairs(tmp_path):
    from conftest import compose_cfg

    from diffalign.config.validation import validate_train_config
    from diffalign.train.preference import train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a red circle", "two blue squares",
                                                                           "a green triangle above a red square"]))
    common = ["model=tiny_random", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.log_with=none",
              "eval.enabled=false", f"data.prompts={prompts}", f"data.pairs_dir={tmp_path / 'pairs'}",
              "data.num_inference_steps=2", "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=1"]
    cfg = compose_cfg(["recipe=tiny_ddspo", f"output_dir={tmp_path / 'ddspo'}", *common])
    assert cfg.method._target_.endswith("DDSPO") and cfg.data.generate
    validate_train_config(cfg)
    results = train(cfg)
    assert results["global_step"] == 2 and (tmp_path / "pairs" / "manifest.json").is_file()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in results["history_tail"])
    mtime = (tmp_path / "pairs" / "shard-00000.safetensors").stat().st_mtime_ns
    dpo = compose_cfg(["recipe=tiny_ddspo", "method=diffusion_dpo", "method.beta=5000",
                       f"output_dir={tmp_path / 'dpo'}", *common])
    assert train(dpo)["global_step"] == 2
    assert (tmp_path / "pairs" / "shard-00000.safetensors").stat().st_mtime_ns == mtime  # reused, not regenerated

    missing = compose_cfg(["recipe=tiny_ddspo", "data.generate=false", f"data.pairs_dir={tmp_path / 'none'}"])
    with pytest.raises(FileNotFoundError, match="data.pairs_dir"):
        validate_train_config(missing)
    with pytest.raises(ValueError, match="data.pairs_dir"):
        validate_train_config(compose_cfg(["data=ddspo_pairs"]))


def _write_shard(path, barrier, fill):
    from diffalign.data import ddspo_pairs

    def write(tmp):
        tmp.write_text(fill * 1000)
        barrier.wait(timeout=60)  # both processes hold a written temporary file before either renames it

    ddspo_pairs._atomic_write(path, write)


def test_processes_writing_the_same_shard_do_not_share_a_temporary_file(tmp_path):
    """Every rank of a launch (and every run sharing data.pairs_dir) generates the missing shards and writes them;
    with one shared temporary name (``shard-00000.jsonl.tmp`` before) the second writer truncated the first's file
    and its rename failed with FileNotFoundError. Two real processes, both writes done before either rename."""
    import multiprocessing
    import os
    import socket

    from diffalign.data.ddspo_pairs import remove_stale_temporaries

    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    path = tmp_path / "shard-00000.jsonl"
    writers = [context.Process(target=_write_shard, args=(path, barrier, fill)) for fill in "ab"]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [w.exitcode for w in writers] == [0, 0]
    assert path.read_text() in ("a" * 1000, "b" * 1000)  # one whole copy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.jsonl"]
    # a killed writer's temporary file is removed at the next start; a live process's and another host's are kept
    dead = context.Process(target=lambda: None)
    dead.start()
    dead.join()
    host = socket.gethostname()
    names = [f".tmp-shard-00001.jsonl-{owner}-0123abcd" for owner in (f"{host}-{dead.pid}", f"{host}-{os.getpid()}",
                                                                        f"node-17-{dead.pid}")]
    for name in names:
        (tmp_path / name).write_text("partial")
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == sorted(names[1:])
