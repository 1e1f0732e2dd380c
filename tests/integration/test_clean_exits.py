"""Issue 19 leftovers: an unreachable ``reward=[http]`` is refused during validation, before the model loads; a
crashing reward ends ``diffalign-eval`` with one line (no traceback) and ``diffalign-train``'s error starts on a line
of its own (not glued to the progress bar). Real servers and real subprocesses."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import CHILD_ENV, REPO
from omegaconf import OmegaConf

from diffalign.config.checks import ConfigError
from diffalign.rewards.brightness import Brightness
from diffalign.rewards.http import HttpReward
from diffalign.rewards.server import RewardServer


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(url: str, **extra):
    return OmegaConf.create({"_target_": "diffalign.rewards.http.HttpReward", "url": url, **extra})


class NoHealthRoute(BaseHTTPRequestHandler):
    """A server of one's own that serves only /score: every GET is a 404."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"not found")

    def log_message(self, *args):
        pass


class Unhealthy(NoHealthRoute):
    def do_GET(self):
        self.send_response(500)
        self.end_headers()
        self.wfile.write(b"model still loading")


def serving(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


def test_an_unreachable_reward_server_is_refused_in_validation_naming_the_url_and_the_fix():
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(ConfigError, match=rf"reward.http.url={url}: the reward server cannot be reached \(GET "
                                          rf"{url}/health: ConnectionError\); start it .*check_health=false"):
        HttpReward.check_config(node(url), "reward.http")
    HttpReward.check_config(node(url, check_health=False), "reward.http")  # asked not to check: accepted
    with pytest.raises(ConfigError, match="reward.http.url is required"):
        HttpReward.check_config(node(""), "reward.http")


def test_the_shipped_server_passes_validation():
    server = serving(RewardServer(Brightness(), ("127.0.0.1", 0)))
    try:
        HttpReward.check_config(node(server.url), "eval_reward.http")
        assert HttpReward(server.url).server_info["status"] == "ok"
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_without_a_health_route_is_accepted_with_a_warning(caplog):
    """404 on /health: a server of one's own without the route; accepted (validation and the reward's own health
    check), with a warning that the first /score request will tell. Any other status is refused."""
    server = serving(ThreadingHTTPServer(("127.0.0.1", 0), NoHealthRoute))
    unhealthy = serving(ThreadingHTTPServer(("127.0.0.1", 0), Unhealthy))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with caplog.at_level(logging.WARNING, logger="diffalign.rewards.http"):
            HttpReward.check_config(node(url), "reward.http")
            assert HttpReward(url, max_retries=0).server_info == {}
        said = [r.getMessage() for r in caplog.records if "no /health route (HTTP 404)" in r.getMessage()]
        assert len(said) == 2 and url in said[0]
        bad = f"http://127.0.0.1:{unhealthy.server_address[1]}"
        with pytest.raises(ConfigError, match=rf"GET {bad}/health answered HTTP 500: .*not healthy"):
            HttpReward.check_config(node(bad), "reward.http")
    finally:
        for s in (server, unhealthy):
            s.shutdown()
            s.server_close()


CRASH = "def crash(images, prompts, metadata=None):\n    raise RuntimeError('scorer exploded')\n"


def run_cli(command: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    (tmp_path / "crashing_reward.py").write_text(CRASH)
    main = {"diffalign-train": "train", "diffalign-eval": "evaluate"}[command]
    code = f"import sys; from diffalign.cli import {main} as main; sys.argv = ['{command}'] + sys.argv[1:]; main()"
    env = {**CHILD_ENV, "PYTHONPATH": f"{tmp_path}:{REPO}"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_unreachable_server_stops_diffalign_eval_before_the_model_loads(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}"
    res = run_cli("diffalign-eval", [f"output_dir={tmp_path / 'eval'}", "model=tiny_random", "reward=[http]",
                                     f"reward.http.url={url}", "report=false"], tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith(f"diffalign: error: reward.http.url={url}: the reward "
                                                          "server cannot be reached")
    assert "Traceback" not in res.stderr and not (tmp_path / "eval" / "samples.jsonl").exists()


@pytest.mark.slow
def test_a_crashing_reward_ends_diffalign_eval_with_one_line(tmp_path):
    res = run_cli("diffalign-eval", [f"output_dir={tmp_path / 'eval'}", "model=tiny_random",
                                     "reward=[python:crashing_reward:crash]", "eval.prompts_per_tag=1",
                                     "eval.seeds=[0]", "eval.sampler.num_inference_steps=2", "report=false"], tmp_path)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("diffalign: error:")]
    assert len(errors) == 1 and "reward 'crash': raised RuntimeError: scorer exploded (batch 0; prompts" in errors[0]


@pytest.mark.slow
def test_diffalign_train_error_is_not_glued_to_the_progress_bar(tmp_path):
    """The reward crashes inside the epochs bar (online loop, first epoch): the error line starts at column 0."""
    res = run_cli("diffalign-train", [f"output_dir={tmp_path / 'run'}", "model=tiny_random", "method=flow_grpo",
                                      "sampler=ddim", "reward=[python:crashing_reward:crash]", "online.num_epochs=1",
                                      "online.groups_per_epoch=1", "online.group_size=2", "trainer.batch_size=2",
                                      "sampler.num_inference_steps=2", "trainer.log_with=none", "eval.enabled=false"],
                  tmp_path)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert "epochs:" in res.stderr  # the bar was open
    errors = [line for line in res.stderr.splitlines() if "diffalign: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("diffalign: error:"), res.stderr[-2000:]
    # the error is the last thing written: the bar is not drawn again after it (as the interpreter exits)
    assert res.stderr.rstrip("\n").rsplit("\n", 1)[-1] == errors[0], repr(res.stderr[-600:])


@pytest.mark.parametrize("command", ["diffalign-train", "diffalign-eval", "diffalign-bench", "diffalign-export",
                                     "diffalign-reward-server", "diffalign-ddspo-pairs", "diffalign-ddcpp-targets"])
def test_help_into_a_closed_pipe_exits_quietly(command, tmp_path):
    """``<command> --help | head -3``: the reader has gone before the help is written. Made deterministic by handing
    the command a pipe whose read end is already closed, so its first write fails with EPIPE. Before, the Hydra
    commands ended in a BrokenPipeError traceback (exit 1). Now: nothing on stderr, and exit 141 (128 + SIGPIPE)
    where the broken pipe reached the command (Hydra's help); argparse's short help ends with 0 (Python's exit
    flush of the unwritten buffer fails silently there)."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    script = (f"import sys; sys.argv = [{command!r}, '--help']; from importlib.metadata import entry_points; "
              f"(ep,) = [e for e in entry_points(group='console_scripts') if e.name == {command!r}]; "
              "sys.exit(ep.load()())")
    try:
        done = subprocess.run([sys.executable, "-c", script], check=False, stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=CHILD_ENV, cwd=tmp_path, timeout=120)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == (141 if command in ("diffalign-train", "diffalign-eval") else 0)
