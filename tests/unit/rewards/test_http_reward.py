"""Rewards served over HTTP (`diffalign.rewards.http` + the reference server `diffalign.rewards.server`), on loopback:
the wire format, scores equal to the in-process reward's, request batching, timeouts and retries, a server that is
down, answers NaN, refuses a batch or dies mid-run, and the asynchronous scoring of both training loops."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from conftest import CHILD_ENV, compose_cfg, online_overrides
from PIL import Image
from plugin_helpers import add_entry_points, fake_distribution, isolated_config_groups  # noqa: F401 - autouse

from diffalign.config import registry
from diffalign.data.onpolicy import sample_and_judge
from diffalign.rewards import reward_set
from diffalign.rewards.base import RewardError
from diffalign.rewards.brightness import Brightness
from diffalign.rewards.compressibility import JpegCompressibility
from diffalign.rewards.geneval_shapes import GenevalShapes
from diffalign.rewards.http import (
    PROTOCOL,
    HttpReward,
    HttpRewardError,
    decode_images,
    decode_output,
    encode_images,
    encode_output,
)
from diffalign.rewards.reward_set import CheckedReward, ChunkScorer, WeightedSum
from diffalign.rewards.server import RewardServer, ServerLimits, main, parse_overrides
from diffalign.samplers.base import build_sampler
from diffalign.types import RewardOutput
from diffalign.world.prompts import load_prompts
from diffalign.world.render import caption, corrupt_spec, render_spec, to_tensor

IMAGES = torch.rand(5, 3, 16, 12, generator=torch.Generator().manual_seed(0))
PROMPTS = [f"prompt {i}" for i in range(5)]


def quantized(images: torch.Tensor) -> torch.Tensor:
    """The 8-bit images a PNG carries, by the protocol's rule floor(255 x + 0.5) / 255, written out here."""
    return torch.floor(images.double() * 255 + 0.5).float() / 255


class Served:
    """A `RewardServer` for `reward` on a free loopback port, serving in a thread until `close`."""

    def __init__(self, reward, **kwargs):
        self.server = RewardServer(reward, ("127.0.0.1", 0), **kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = self.server.url

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    started = []

    def start(reward, **kwargs):
        served = Served(reward, **kwargs)
        started.append(served)
        return served

    yield start
    for served in started:
        served.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counting:
    """Brightness that counts its calls and can sleep or fail on chosen calls."""

    name, differentiable = "counting", False

    def __init__(self, sleep_calls=(), sleep=0.0, nan_rows=(), raise_error=None, gate=None, nan_from_call=1):
        self.calls, self.sleep_calls, self.sleep = 0, set(sleep_calls), sleep
        self.nan_rows, self.raise_error, self.gate = list(nan_rows), raise_error, gate
        self.nan_from_call = nan_from_call
        self.lock = threading.Lock()

    def __call__(self, images, prompts, metadata=None):
        with self.lock:
            self.calls += 1
            call = self.calls
        if self.gate is not None:
            assert self.gate.wait(10)
        if call in self.sleep_calls:
            time.sleep(self.sleep)
        if self.raise_error is not None:
            raise self.raise_error
        out = Brightness()(images, prompts)
        if call >= self.nan_from_call:
            out.scores[self.nan_rows] = float("nan")
        return out


# ------------------------------------------------------------------------------------------------ wire format


@pytest.mark.parametrize("fmt", ["png", "uint8", "float32"])
def test_image_formats_round_trip(fmt):
    videos = torch.rand(2, 3, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    for batch in (IMAGES, videos):
        obj = json.loads(json.dumps(encode_images(batch, fmt)))  # through JSON, as on the wire
        back = decode_images(obj)
        assert back.dtype == torch.float32 and back.shape == batch.shape
        expected = batch if fmt == "float32" else quantized(batch)
        assert torch.equal(back, expected)
    # one value by hand: 0.5 → floor(127.5 + 0.5) = 128
    assert torch.equal(decode_images(encode_images(torch.full((1, 3, 1, 1), 0.5), fmt)),
                       torch.full((1, 3, 1, 1), 0.5 if fmt == "float32" else 128 / 255))


def test_png_wire_format_is_plain_png_a_foreign_server_can_read():
    """What another language's server sees: base64 PNGs it decodes with any PNG library, RGB, H × W as the shape."""
    obj = encode_images(IMAGES[:2], "png")
    assert obj["shape"] == [2, 3, 16, 12] and len(obj["data"]) == 2
    image = Image.open(io.BytesIO(base64.b64decode(obj["data"][1])))
    assert image.format == "PNG" and image.mode == "RGB" and image.size == (12, 16)
    pixel = np.asarray(image)[3, 4]  # row 3, column 4
    assert pixel.tolist() == [int(np.floor(float(IMAGES[1, c, 3, 4]) * 255 + 0.5)) for c in range(3)]
    raw = encode_images(IMAGES[:2], "float32")
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"]), "<f4").reshape(raw["shape"]),
                          IMAGES[:2].numpy())


def test_bad_images_and_answers_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        encode_images(IMAGES * 2)
    with pytest.raises(ValueError, match="image format 'jpeg'"):
        encode_images(IMAGES, "jpeg")
    with pytest.raises(ValueError, match=r"images.data must be a list of 5"):
        decode_images({"format": "png", "shape": [5, 3, 16, 12], "data": []})
    with pytest.raises(ValueError, match="do not fill shape"):
        decode_images({"format": "float32", "shape": [5, 3, 16, 12], "data": base64.b64encode(b"1234").decode()})
    with pytest.raises(ValueError, match="'scores' must be a list of 2 numbers"):
        decode_output({"scores": [1.0]}, 2)
    with pytest.raises(ValueError, match=r"info\['correct'\] must be a list of 2"):
        decode_output({"scores": [1.0, 2.0], "info": {"correct": [True]}}, 2)
    out = decode_output({"scores": [1, None, float("nan")], "info": {"ok": [True, False, True], "n": [1, 2, 3],
                                                                      "tag": ["a", "b", "c"]}}, 3)
    assert out.scores.dtype == torch.float32 and out.scores[0] == 1 and out.scores[1:].isnan().all()
    assert out.info["ok"].dtype == torch.bool and out.info["n"].dtype == torch.int64 and out.info["tag"] == list("abc")


def test_encode_output_sends_null_for_non_finite_and_per_sample_info_only():
    out = RewardOutput(torch.tensor([0.5, float("inf")]), info={"correct": torch.tensor([True, False]),
                                                                "mean": 3.0, "tag": ["a", "b"]},
                       maps=torch.ones(2, 4, 4))
    answer = json.loads(json.dumps(encode_output(out, 2)))
    assert answer["scores"] == [0.5, None] and set(answer["info"]) == {"correct", "tag"}
    assert torch.equal(decode_output(answer, 2).maps, torch.ones(2, 4, 4))


# ------------------------------------------------------------------------------------------------ scores over HTTP


@pytest.mark.parametrize("fmt", ["float32", "png"])
def test_served_brightness_equals_the_in_process_reward(serve, fmt):
    """float32 travels exactly: identical scores and maps; PNG carries the 8-bit images: identical to the in-process
    reward on those."""
    served = serve(Brightness(), name="brightness")
    reward = HttpReward(served.url, image_format=fmt)
    assert reward.server_info == {"status": "ok", "protocol": PROTOCOL, "reward": "brightness", "modality": "any",
                                  "differentiable": False, "limits": dataclasses.asdict(ServerLimits())}
    out = reward(IMAGES, PROMPTS)
    expected = Brightness()(IMAGES if fmt == "float32" else quantized(IMAGES), PROMPTS)
    assert torch.equal(out.scores, expected.scores) and torch.equal(out.maps, expected.maps)
    if fmt == "png":
        assert not torch.equal(out.scores, Brightness()(IMAGES, PROMPTS).scores)  # the test can tell them apart


def test_served_geneval_shapes_equals_the_in_process_verifier(serve):
    """The verifier quantises to 8 bits itself, so over PNG its scores, correctness and failed constraints are the
    in-process ones exactly; metadata (GenEval constraints) travel as JSON."""
    rows = load_prompts("heldout")[:6]
    arrays = [render_spec(row, seed=k) if k % 2 == 0 else render_spec(corrupt_spec(row, seed=k)[0], seed=k)
              for k, row in enumerate(rows)]
    noise = torch.rand(6, 3, *arrays[0].shape[:2], generator=torch.Generator().manual_seed(2)) * 0.02
    images = (to_tensor(np.stack(arrays)) + noise).clamp(0, 1)
    prompts = [row["prompt"] for row in rows]
    assert prompts[0] == caption(rows[0])
    served = serve(GenevalShapes(), name="geneval_shapes")
    out = HttpReward(served.url, max_batch_size=4)(images, prompts, rows)
    expected = GenevalShapes()(images, prompts, rows)
    assert torch.equal(out.scores, expected.scores)
    assert torch.equal(out.info["correct"], expected.info["correct"]) and expected.info["correct"].any()
    assert not expected.info["correct"].all()
    assert out.info["failed"] == expected.info["failed"] and out.info["tag"] == expected.info["tag"]


def test_large_batches_are_split_into_requests_in_order(serve):
    served = serve(Counting())
    reward = HttpReward(served.url, max_batch_size=2, image_format="float32")
    out = reward(IMAGES, PROMPTS)
    assert served.server.requests_scored == 3  # 2 + 2 + 1 images
    assert torch.equal(out.scores, Brightness()(IMAGES, PROMPTS).scores)


def test_submit_returns_before_the_server_answers(serve):
    """The asynchronous API: the future is pending while the server is still scoring."""
    gate = threading.Event()
    served = serve(Counting(gate=gate))
    future = HttpReward(served.url, image_format="float32").submit(IMAGES, PROMPTS)
    time.sleep(0.2)
    assert not future.done()
    gate.set()
    assert torch.equal(future.result(timeout=10).scores, Brightness()(IMAGES, PROMPTS).scores)


# ------------------------------------------------------------------------------------------------ failures


def test_slow_server_times_out_then_the_retry_succeeds(serve):
    counting = Counting(sleep_calls={1}, sleep=2.0)
    served = serve(counting, max_concurrent=2)
    reward = HttpReward(served.url, timeout=0.5, max_retries=2, backoff=0.05, image_format="float32")
    out = reward(IMAGES, PROMPTS)
    assert counting.calls == 2  # the first request timed out, its retry was answered
    assert torch.equal(out.scores, Brightness()(IMAGES, PROMPTS).scores)


def test_slow_server_exhausting_the_retries_names_the_server(serve):
    served = serve(Counting(sleep_calls={1, 2, 3}, sleep=1.0), max_concurrent=3)
    reward = HttpReward(served.url, timeout=0.2, max_retries=1, backoff=0.0)
    start = time.monotonic()
    with pytest.raises(HttpRewardError, match=rf"reward server {re.escape(served.url)} did not answer a batch of 5 "
                                              r"after 2 attempt\(s\) \(timeout 0.2 s each; last: timed out"):
        reward(IMAGES, PROMPTS)
    assert time.monotonic() - start < 3


def test_a_server_that_is_down_is_reported_when_the_reward_is_built():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(HttpRewardError, match=rf"reward server {re.escape(url)} did not answer the health check "
                                              r"after 2 attempt\(s\).*connection failed.*diffalign-reward-server"):
        HttpReward(url, max_retries=1, backoff=0.0)


def test_bad_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="reward.http.url is required"):
        HttpReward("")
    with pytest.raises(ValueError, match="reward.http.url is required"):
        HttpReward("localhost:8000")
    with pytest.raises(ValueError, match="reward.http.max_batch_size=0"):
        HttpReward("http://127.0.0.1:1", max_batch_size=0, check_health=False)
    with pytest.raises(ValueError, match="reward.http.image_format='jpeg'"):
        HttpReward("http://127.0.0.1:1", image_format="jpeg", check_health=False)


def test_a_reward_error_on_the_server_is_not_retried_and_its_message_arrives(serve):
    counting = Counting(raise_error=ValueError("expects a shapes-world caption"))
    served = serve(counting)
    with pytest.raises(HttpRewardError, match=r"refused a batch of 5: HTTP 422: reward 'counting' raised ValueError: "
                                              r"expects a shapes-world caption"):
        HttpReward(served.url, max_retries=3, backoff=5.0)(IMAGES, PROMPTS)
    assert counting.calls == 1
    bad = requests.post(f"{served.url}/score", data=json.dumps({"protocol": "other/9"}), timeout=5)
    assert bad.status_code == 400 and "protocol 'other/9'" in bad.json()["error"]


def test_nan_from_the_server_stops_through_the_reward_guard_naming_the_reward(serve):
    served = serve(Counting(nan_rows=[1]))
    reward = CheckedReward("http", HttpReward(served.url))
    reward.step = 7
    with pytest.raises(RewardError, match=r"reward 'http': returned non-finite scores \[nan\] at batch rows \[1\] "
                                          r"\(step 7; batch 0; prompt 'prompt 1'\)"):
        reward(IMAGES, PROMPTS)
    with pytest.raises(RewardError, match=r"reward 'http': returned non-finite.*batch 1"):  # the same via submit
        reward.submit(IMAGES, PROMPTS).result(timeout=10)


def test_checked_submit_of_a_failing_server_raises_a_reward_error_naming_the_url(serve):
    served = serve(Counting())
    reward = CheckedReward("judge", HttpReward(served.url, max_retries=0))
    served.close()
    with pytest.raises(RewardError, match=rf"reward 'judge': raised HttpRewardError: reward server "
                                          rf"{re.escape(served.url)} did not answer"):
        reward.submit(IMAGES, PROMPTS).result(timeout=10)


@pytest.mark.parametrize("fmt", ["png", "float32"])
def test_the_standalone_server_template_speaks_the_protocol(fmt, capsys):
    """The one-file server for other environments (no diffalign, no torch) against the client: its example score, the
    mean luma, matches `brightness` on what it receives (float64 there, float32 here); images and videos."""
    from diffalign.rewards import standalone_server

    assert main(["--template"]) == 0
    source = capsys.readouterr().out
    assert source == Path(standalone_server.__file__).read_text(encoding="utf-8")
    assert not re.search(r"^\s*(import|from) (diffalign|torch)", source, re.MULTILINE)
    server = standalone_server.ThreadingHTTPServer(("127.0.0.1", 0), standalone_server.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reward = HttpReward(f"http://127.0.0.1:{server.server_address[1]}", image_format=fmt, max_batch_size=2)
        assert reward.server_info["reward"] == "mean_luma"
        videos = torch.rand(3, 2, 3, 8, 6, generator=torch.Generator().manual_seed(3))
        for batch in (IMAGES, videos):
            sent = batch if fmt == "float32" else quantized(batch)
            torch.testing.assert_close(reward(batch, PROMPTS[:len(batch)]).scores, Brightness()(sent, []).scores,
                                       rtol=0, atol=1e-6)
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------------ the loops


def test_chunk_scorer_equals_one_weighted_sum_call_on_the_whole_epoch(serve):
    """Chunks go to the server as they come; weights and z-scores still apply to the whole epoch."""
    served = serve(Brightness())
    http = HttpReward(served.url, image_format="float32", max_batch_size=2)
    weights, normalize = {"bright": 0.5, "jpeg": 2.0}, {"bright": "zscore", "jpeg": "none"}
    scorer = ChunkScorer(WeightedSum({"bright": http, "jpeg": JpegCompressibility()}, weights, normalize))

    class Part:
        def __init__(self, rows):
            self.images, self.prompts = IMAGES[rows], PROMPTS[rows]

    for start, stop in ((0, 3), (3, 5)):
        scorer.add(Part(slice(start, stop)), start, stop)
    out = scorer.result(IMAGES, PROMPTS)
    expected = WeightedSum({"bright": Brightness(), "jpeg": JpegCompressibility()}, weights, normalize)(IMAGES,
                                                                                                      PROMPTS)
    assert torch.equal(out.scores, expected.scores)
    assert torch.equal(out.info["scores/bright"], expected.info["scores/bright"])
    assert served.server.requests_scored == 3  # 2 + 1, then 2


def test_on_policy_data_judged_by_a_server_equal_the_in_process_data(serve, tiny_policy):
    """The preference loop's data preparation sends batch k while sampling batch k + 1; the data are the same."""
    rows = load_prompts("train")[:3]
    sampler = build_sampler({"name": "ddim", "num_inference_steps": 2, "guidance_scale": 1.0, "eta": 0.0})
    local = sample_and_judge(tiny_policy, rows, 2, GenevalShapes(), sampler=sampler, batch_size=4, seed=0)
    served = serve(GenevalShapes())
    remote = sample_and_judge(tiny_policy, rows, 2, CheckedReward("judge", HttpReward(served.url, max_batch_size=2)),
                              sampler=sampler, batch_size=4, seed=0)
    assert served.server.requests_scored == 3  # chunks of 4 and 2 images, at most 2 per request: 2 + 1
    assert torch.equal(remote.images, local.images) and remote.jobs == local.jobs
    assert torch.equal(remote.scores, local.scores) and torch.equal(remote.correct, local.correct)


def test_http_is_a_registered_reward_with_a_config():
    registry.register_configs()
    cfg = compose_cfg(["reward=[http]", "reward.http.url=http://127.0.0.1:9", "reward.http.max_batch_size=4"])
    assert cfg.reward.http._target_ == "diffalign.rewards.http.HttpReward"
    assert cfg.reward.http.max_batch_size == 4 and cfg.reward.http.image_format == "png"
    assert parse_overrides(["score=binary", "value_range=[-1,1]"]) == {"score": "binary", "value_range": [-1, 1]}


def test_two_servers_in_one_run_through_two_entry_point_names(serve, tmp_path, monkeypatch):
    """docs/guides/rewards.md: the same config under two entry-point names selects two servers, each with its own
    url."""
    dist = fake_distribution(tmp_path, "my-judges", "[diffalign.rewards]\n"
                             "ocr = diffalign.rewards.http:HttpRewardConfig\n"
                             "judge = diffalign.rewards.http:HttpRewardConfig\n")
    add_entry_points(monkeypatch, dist)
    bright, jpeg = serve(Brightness(), name="brightness"), serve(JpegCompressibility(), name="jpeg")
    cfg = compose_cfg(["reward=[ocr,judge]", f"reward.ocr.url={bright.url}", f"reward.judge.url={jpeg.url}",
                       "reward.judge.weight=0.5", "reward.ocr.image_format=float32"])
    out = reward_set.build_rewards(cfg.reward)(IMAGES, PROMPTS)
    expected = Brightness()(IMAGES, PROMPTS).scores + 0.5 * JpegCompressibility()(quantized(IMAGES), PROMPTS).scores
    assert torch.equal(out.scores, expected)


def test_server_command_refuses_an_unknown_reward(capsys):
    assert main(["no_such_reward", "--port", "0"]) == 2
    assert "cannot serve 'no_such_reward'" in capsys.readouterr().err


def test_nan_from_the_server_stops_an_online_run_with_the_epochs_checkpoint(serve, tmp_path):
    """NaN in row 2 of both rollout batches of the second epoch (rows 2 and 6 of the epoch): the run stops with the
    checkpoint written at the end of epoch 1 (reused, not written twice), naming the reward and the non-finite rows."""
    from diffalign.train.online import train

    served = serve(Counting(nan_rows=[2], nan_from_call=3))
    cfg = compose_cfg(["model=tiny_random", "method=flow_grpo", "sampler=ddim", "online.rollout_batch_size=4"]
                      + online_overrides(tmp_path, epochs=3) + ["reward=[http]", f"reward.http.url={served.url}"])
    with pytest.raises(RewardError, match=r"reward 'http': returned non-finite scores \[nan, nan\] at batch rows "
                                          r"\[2, 6\] — checkpoint saved to .*checkpoint-1; fix or deselect the "
                                          r"reward.*\(step 1; batch 0") as info:  # checked once on the epoch
        train(cfg)
    assert info.value.checkpoint == tmp_path / "checkpoint-1" and info.value.step == 1
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]


# ------------------------------------------------------------------------------------------------ end to end


def test_an_online_run_on_a_served_reward_equals_the_in_process_run(serve, tmp_path):
    """The online loop sends each rollout batch while sampling the next (ChunkScorer); with float32 images the run is
    the in-process run bit for bit: same logged rewards, same LoRA."""
    from safetensors.torch import load_file

    from diffalign.train.online import train

    served = serve(Brightness())
    common = ["model=tiny_random", "method=flow_grpo", "sampler=ddim", "online.rollout_batch_size=4",
              "eval_reward=[brightness]"]
    local = train(compose_cfg(common + online_overrides(tmp_path / "local") + ["reward=[brightness]"]))
    remote = train(compose_cfg(common + online_overrides(tmp_path / "remote") + [
        "reward=[http]", f"reward.http.url={served.url}", "reward.http.image_format=float32"]))
    assert served.server.requests_scored == 4  # 2 epochs × 2 rollout batches of 4
    assert local["global_step"] == remote["global_step"] == 2
    history = [[json.loads(line) for line in (tmp_path / run / "history.jsonl").read_text().splitlines()]
               for run in ("local", "remote")]
    assert [h["reward/brightness/mean"] for h in history[0]] == [h["reward/http/mean"] for h in history[1]]
    assert [h["loss"] for h in history[0]] == [h["loss"] for h in history[1]]
    a, b = (load_file(tmp_path / run / "final" / "pytorch_lora_weights.safetensors") for run in ("local", "remote"))
    assert all(torch.equal(a[k], b[k]) for k in a)


DYING_REWARD = textwrap.dedent('''
    import os

    import torch

    CALLS = {"n": 0}


    def dies_on_third_batch(images, prompts, metadata=None):
        """Mean pixel value; the server process dies (no answer) on its third batch."""
        CALLS["n"] += 1
        if CALLS["n"] == 3:
            os._exit(1)
        return images.flatten(1).mean(1).float()
''')


@pytest.mark.slow
def test_online_run_stops_with_a_checkpoint_naming_the_server_when_it_dies(tmp_path):
    """``diffalign-reward-server`` in its own process serves two rollout batches per epoch, then dies during the
    second epoch: the run stops with the checkpoint of that point, and the error names the server's URL."""
    (tmp_path / "dying_reward.py").write_text(DYING_REWARD)
    env = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), CHILD_ENV["PYTHONPATH"]])}
    server = subprocess.Popen([sys.executable, "-m", "diffalign.rewards.server",
                               "python:dying_reward:dies_on_third_batch", "--port", "0"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+) ", line)
        assert match, line + server.stderr.read()
        url = match.group(1)
        assert requests.get(f"{url}/health", timeout=5).json()["reward"] == "python:dying_reward:dies_on_third_batch"
        from diffalign.train.online import train

        cfg = compose_cfg(["model=tiny_random", "method=flow_grpo", "sampler=ddim"] + online_overrides(
            tmp_path / "run", epochs=3) + ["reward=[http]", f"reward.http.url={url}", "reward.http.max_retries=1",
                                           "reward.http.backoff=0.1", "online.rollout_batch_size=4"])
        with pytest.raises(RewardError, match=rf"reward 'http': raised HttpRewardError: reward server "
                                              rf"{re.escape(url)} did not answer a batch of 4 after 2 attempt\(s\)"
                                              r".*checkpoint saved to .*checkpoint-1") as info:
            train(cfg)
        assert server.wait(timeout=10) == 1  # the server did die
    finally:
        server.kill()
        server.wait()
    assert info.value.checkpoint is not None and info.value.checkpoint.name == "checkpoint-1"
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
