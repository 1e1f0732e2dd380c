"""The bad-input catalogue (issue 10 item 5; docs/guides/reliability.md): one test per input, each with a clear
outcome.

Covered elsewhere and listed in the docs: an empty prompt file (test_cli), a missing prompt file (test_cli,
test_online), grey/RGBA/palette/CMYK images (test_data_loaders::test_rgb_conversion_and_center_crop), corrupt and
truncated images (test_data_loaders::test_corrupt_image_names_the_file_and_row), a LoRA of another rank
(test_stable_diffusion_policy), a half-written checkpoint (test_faults::test_sigkill_mid_save...).
"""

from __future__ import annotations

import io
import json
import logging
import shutil

import numpy as np
import pytest
import torch
from conftest import compose_cfg, png_bytes, smoke_overrides
from PIL import Image

from diffalign.config.validation import validate_train_config
from diffalign.data.images import load_image
from diffalign.data.pickapic import PickAPicPairs
from diffalign.models.tiny_flow import build_tiny_flow_policy
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.runtime.checkpoint import load_checkpoint, save_checkpoint
from diffalign.world.prompts import load_prompts


@pytest.mark.parametrize("line", ['{"prompt": ""}', '{"prompt": "   \\t"}', '{"prompt": 3}'])
def test_empty_whitespace_or_non_text_prompt_names_the_line(tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a red circle"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=r"online.prompts: .*p.jsonl:3: prompt .* is empty or not text"):
        load_prompts(str(path), field="online.prompts")


def test_blank_lines_are_skipped_and_a_whitespace_only_file_is_empty(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a red circle\n   \n\t\nred square\n")
    assert [r["prompt"] for r in load_prompts(str(path))] == ["a red circle", "red square"]
    path.write_text("  \n\t\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(path))


def test_bad_json_line_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not a JSON object"):
        load_prompts(str(path))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv"])
def test_non_utf8_prompt_file_names_the_line_and_the_fix(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    body = {".txt": "a red circle\ncaf\xe9\n", ".jsonl": '{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
            ".csv": "prompt\na\ncaf\xe9\n"}[suffix]
    path.write_bytes(body.encode("latin-1"))
    line = 3 if suffix == ".csv" else 2
    with pytest.raises(ValueError, match=rf"data.prompts: .*p{suffix}:{line} is not UTF-8 .*b'\\xe9'.*iconv"):
        load_prompts(str(path))
    path.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8"))  # UTF-8 with a BOM is fine
    assert load_prompts(str(path))[-1]["prompt"] == "café"


def test_prompt_longer_than_the_text_context_is_truncated_with_one_warning(caplog):
    policy = build_tiny_random_policy(seed=0)
    limit = policy.tokenizer.model_max_length
    text = "a red circle left of a green square and a blue triangle above a yellow circle"
    words = text.split(" ")
    assert len(policy.tokenizer(text).input_ids) > limit
    kept = next(" ".join(words[:n]) for n in range(len(words), 0, -1)
                if len(policy.tokenizer(" ".join(words[:n])).input_ids) <= limit)
    with caplog.at_level(logging.WARNING, logger="diffalign.models.stable_diffusion"):
        long = policy.encode_prompts([" ".join(words)], do_classifier_free_guidance=False).prompt_embeds
        policy.encode_prompts([" ".join(words)], do_classifier_free_guidance=False)
    warnings = [r for r in caplog.records if "the text encoder reads only the first" in r.getMessage()]
    assert len(warnings) == 1 and f"only the first {limit}" in warnings[0].getMessage()
    short = policy.encode_prompts([kept], do_classifier_free_guidance=False).prompt_embeds
    # the truncated prompt is the prompt's first `limit` tokens: same embedding where the kept prefix ends
    n = len(policy.tokenizer(kept).input_ids) - 1
    assert long.shape == short.shape and torch.allclose(long[0, :n], short[0, :n], atol=1e-6)


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_16_bit_grey_png_is_scaled_not_clipped():
    grey = np.array([[0, 257 * 64], [257 * 128, 65535]], dtype=np.uint16)
    data = _png(grey)
    assert Image.open(io.BytesIO(data)).mode.startswith("I")
    image = load_image(data, "row 0 jpg_0", None)
    assert image.shape == (3, 2, 2)
    assert (image[0] * 255).round().tolist() == [[0, 64], [128, 255]] and torch.equal(image[0], image[2])


def test_float_image_is_rejected_naming_the_row():
    with pytest.raises(ValueError, match=r"row 7 jpg_1: floating-point \(mode F\) images are not supported"):
        load_image(Image.fromarray(np.zeros((4, 4), dtype=np.float32)), "row 7 jpg_1", 4)


def test_mismatched_image_sizes_are_resized_and_cropped_to_the_resolution(tmp_path):
    sizes = [((12, 10), (20, 20)), ((8, 8), (40, 24))]  # winner and loser of each row differ, rows differ
    rows = []
    for i, (size_0, size_1) in enumerate(sizes):
        (tmp_path / f"{i}_0.png").write_bytes(png_bytes((255, 0, 0), size=size_0, mode="RGBA"))
        (tmp_path / f"{i}_1.png").write_bytes(png_bytes((0, 0, 255), size=size_1, mode="L"))
        rows.append({"caption": f"p{i}", "jpg_0": f"{i}_0.png", "jpg_1": f"{i}_1.png", "label_0": 1, "label_1": 0})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = PickAPicPairs(str(tmp_path / "pairs.jsonl"), resolution=8).collate([0, 1])
    assert batch["images_w"].shape == batch["images_l"].shape == (2, 3, 8, 8)


def test_data_resolution_other_than_the_model_fails_naming_the_field(tmp_path):
    from diffalign.train.preference import train

    with pytest.raises(ValueError, match=r"set data.resolution=32"):
        train(_pickapic_cfg(tmp_path, resolution=16))


def _pickapic_cfg(tmp_path, resolution):
    rows = []
    for i in range(2):
        (tmp_path / f"{i}_0.png").write_bytes(png_bytes((255, 0, 0), size=(20, 20)))
        (tmp_path / f"{i}_1.png").write_bytes(png_bytes((0, 0, 255), size=(20, 20)))
        rows.append({"caption": "a red circle", "jpg_0": f"{i}_0.png", "jpg_1": f"{i}_1.png", "label_0": 1,
                     "label_1": 0})
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in smoke_overrides(tmp_path / "run") if not o.startswith("data.")]
    return compose_cfg(overrides + ["data=pickapic", f"data.path={tmp_path / 'pairs.jsonl'}",
                                    f"data.resolution={resolution}"])


@pytest.mark.parametrize("saved_by,loaded_by,match", [
    ("flow", "sd", r"holds LoRA weights for \['transformer'\] modules, not for a UNet"),
    ("sd", "flow", r"holds LoRA weights for \['unet'\] modules, not for an SD3-format transformer"),
])
def test_lora_folder_of_another_architecture_is_rejected(tmp_path, saved_by, loaded_by, match):
    build = {"sd": lambda: build_tiny_random_policy(seed=0), "flow": lambda: build_tiny_flow_policy(seed=0)}
    build[saved_by]().save_lora_weights(tmp_path)
    with pytest.raises(ValueError, match=match):
        build[loaded_by]().load_lora_weights(tmp_path)


def test_truncated_lora_file_is_named(tmp_path):
    policy = build_tiny_random_policy(seed=0)
    policy.save_lora_weights(tmp_path)
    file = tmp_path / "pytorch_lora_weights.safetensors"
    file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"pytorch_lora_weights.safetensors.*cannot be read.*truncated or damaged"):
        policy.load_lora_weights(tmp_path)


def _two_checkpoints(tmp_path):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param])
    param.grad = torch.ones(3)
    optimizer.step()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, lora_dir_writer=lambda d: None, optimizer=optimizer, lr_scheduler=None,
                        state={"global_step": step})
    return optimizer


@pytest.mark.parametrize("name", ["optimizer.safetensors", "rng_state.safetensors", "optimizer.json",
                                  "trainer_state.json"])
def test_truncated_checkpoint_file_names_the_file_and_earlier_checkpoints(tmp_path, name):
    optimizer = _two_checkpoints(tmp_path)
    file = tmp_path / "checkpoint-2" / name
    file.write_bytes(file.read_bytes()[: len(file.read_bytes()) // 2])
    with pytest.raises(ValueError, match=rf"checkpoint-2/{name} is truncated or damaged.*\['checkpoint-1'\]"):
        load_checkpoint(tmp_path / "checkpoint-2", optimizer=optimizer, lr_scheduler=None)
    assert load_checkpoint(tmp_path / "checkpoint-1", optimizer=optimizer, lr_scheduler=None)["global_step"] == 1


def test_checkpoint_missing_a_state_file(tmp_path):
    optimizer = _two_checkpoints(tmp_path)
    (tmp_path / "checkpoint-2" / "rng_state.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"checkpoint-2 is not a complete checkpoint directory \(no "
                                                r"rng_state.json\)"):
        load_checkpoint(tmp_path / "checkpoint-2", optimizer=optimizer, lr_scheduler=None)


def test_resume_from_a_missing_or_non_checkpoint_folder_fails_before_models_load(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"resume='.*nope' is not a checkpoint folder"):
        validate_train_config(compose_cfg(smoke_overrides(tmp_path / "run") + [f"resume={tmp_path / 'nope'}"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no trainer_state.json"):
        validate_train_config(compose_cfg(smoke_overrides(tmp_path / "run") + [f"resume={tmp_path / 'empty'}"]))


def test_resume_latest_with_a_truncated_latest_checkpoint_stops_naming_it(tmp_path):
    from diffalign.train.preference import train

    train(compose_cfg(smoke_overrides(tmp_path, steps=2)))
    file = tmp_path / "checkpoint-2" / "optimizer.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"checkpoint-2/optimizer.safetensors is truncated.*\['checkpoint-1'\]"):
        train(compose_cfg(smoke_overrides(tmp_path, steps=3) + ["resume=latest"]))
    # the earlier checkpoint in the same folder would run into checkpoint-2 (refused); the message's first fix works
    with pytest.raises(ValueError, match=r"already holds later checkpoints \(checkpoint-2\)"):
        train(compose_cfg(smoke_overrides(tmp_path, steps=3) + [f"resume={tmp_path / 'checkpoint-1'}"]))
    shutil.rmtree(tmp_path / "checkpoint-2")
    results = train(compose_cfg(smoke_overrides(tmp_path, steps=3) + ["resume=latest"]))
    assert results["global_step"] == 3


# The new-user trial's silent and late failures (issue 32 item 1): each refused by diffalign.train.prepare.check_run,
# before any model loads, with one line naming the field and the fix.
ONLINE_SMALL = ["recipe=tiny_flow_grpo", "online.groups_per_epoch=2", "online.group_size=4", "trainer.log_with=none"]


def _refusal(tmp_path, overrides: list[str], monkeypatch=None) -> str:
    """The message `check_run` refuses the composed config with (it fails the test when the config passes)."""
    from diffalign.train.prepare import check_run

    cfg = compose_cfg([f"output_dir={tmp_path / 'run'}", "trainer.log_with=none", *overrides])
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        check_run(cfg, overrides)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("overrides,expected", [
    # silent, wrong statistics: each sample counted twice, standard errors ~√2 too small, images overwritten
    (["eval.seeds=[0,0]"], r"eval.seeds=\[0, 0\] repeats \[0\]: .* pass distinct seeds, e.g. eval.seeds=\[0\]"),
    (["monitor.every=1", "monitor.seeds=[1,2,1]"], r"monitor.seeds=\[1, 2, 1\] repeats \[1\]"),
    # silent "trains nothing"
    (["trainer.max_steps=10", "trainer.lr_warmup_steps=1000"],
     (r"trainer.lr_warmup_steps=1000 is far beyond the run's 10 optimizer updates \(trainer.max_steps=10\): the "
     r"learning rate would stay under 1.0% .* pass trainer.lr_warmup_steps <= 10")),
    ([*ONLINE_SMALL, "reward.geneval_shapes.weight=0"],
     r"every training reward has weight 0 \(reward.geneval_shapes.weight=0\).* every advantage would be 0"),
    ([*ONLINE_SMALL, "online.updates_per_epoch=1000"],
     r"online.updates_per_epoch=1000 but an epoch gives each process 8 rows x \d+ sampler steps"),
    # typos with + outside the structured groups
    (["+monitor.evry=1"], r"monitor.evry is not a setting of monitor \(MonitorConfig\); did you mean monitor.every"),
    (["+output=runs/x"], r"output is not a setting of train.yaml; did you mean output_dir"),
    (["+resume_from=runs/x/checkpoint-2"], r"resume_from is not a setting of train.yaml; did you mean resume"),
    (["+accelerate=fsdp"], (r"\+accelerate=\.\.\. is not a setting of the run.*accelerate launch --config_file "
                           r"configs/accelerate/fsdp.yaml -m diffalign.cli")),
    # late failures a check before work catches
    (["method=ddspo"], (r"method=ddspo with method.cpp=tf needs the degraded prompts c⁻ of DDSPO pairs, but "
                       r"data=FailurePairs has none; pass data=ddspo_pairs")),
    (["data=failure_pairs", "reward=[brightness,geneval_shapes]", "data.reward=brightness"],
     r"data.reward='brightness' does not report per-sample correctness .* data.reward=geneval_shapes"),
    (["reward=[http]", "reward.http.url=http://127.0.0.1:8000", "reward.http.check_health=false",
      "reward.http.backoff=nan"], r"reward.http.backoff must be a number >= 0, got nan"),
    (["reward=[http]", "reward.http.url=http://127.0.0.1:99999", "reward.http.check_health=false"],
     r"reward.http.url=http://127.0.0.1:99999: Port out of range 0-65535"),
])
def test_silent_or_late_failures_are_refused_before_any_model_loads(tmp_path, overrides, expected):
    import re

    message = _refusal(tmp_path, overrides)
    assert re.search(expected, message), message


def test_online_prompts_are_checked_against_the_verifier_like_eval_prompts(tmp_path):
    """``online.prompts`` is scored by the training rewards: a prompt file the GenEval-shapes verifier cannot score is
    refused before the rollouts (it was, for ``eval.prompts``, but not for the online prompts)."""
    prompts = tmp_path / "mine.txt"
    prompts.write_text("a photo of a cat\na watercolor landscape\n")
    message = _refusal(tmp_path, [*ONLINE_SMALL, f"online.prompts={prompts}"])
    assert f"online.prompts='{prompts}'" in message and "geneval_shapes" in message, message


def test_fsdp_on_a_machine_without_a_gpu_needs_trainer_cpu():
    from diffalign.runtime.distributed import check_launch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    cfg = compose_cfg(["trainer.cpu=false"])
    with pytest.raises(ValueError, match=r"an FSDP launch on a machine without a GPU: pass trainer.cpu=true"):
        check_launch(cfg, env={"ACCELERATE_USE_FSDP": "true"})
    check_launch(compose_cfg(["trainer.cpu=true"]), env={"ACCELERATE_USE_FSDP": "true"})  # (gloo on CPU: runs)


def test_a_top_level_typo_of_diffalign_eval_is_refused():
    """``diffalign-eval +checkpont=<folder>`` added a key nothing reads (the base alone was evaluated)."""
    from diffalign.config.checks import check_top_level_keys
    from diffalign.config.validation import train_config_keys

    keys = train_config_keys("evaluate")
    check_top_level_keys(compose_cfg([], name="evaluate"), keys, "evaluate.yaml")  # the shipped config passes
    with pytest.raises(ValueError, match=r"^checkpont is not a setting of evaluate.yaml; did you mean checkpoint, "
                                         r"checkpoints\? drop \+checkpont=\.\.\."):
        check_top_level_keys(compose_cfg(["+checkpont=runs/x/final"], name="evaluate"), keys, "evaluate.yaml")
