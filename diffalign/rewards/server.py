"""``diffalign-reward-server``: the reference server of the ``diffalign-reward/1`` protocol (`diffalign.rewards.http`).

It serves any installed reward plugin (or a ``python:<module>:<function>`` one-off) by name, with its config fields
given as ``field=value``, so a reward whose dependencies cannot live in the training environment runs in its own::

    diffalign-reward-server geneval_shapes score=binary --host 127.0.0.1 --port 8000
    diffalign-train recipe=tiny_ddpo reward=[http] reward.http.url=http://127.0.0.1:8000

Endpoints: ``GET /health`` → ``{"status": "ok", "protocol", "reward", "modality", "differentiable"}``; ``POST /score``
(the request and answer of docs/guides/rewards.md#rewards-served-over-http). A request that is not the protocol gets
HTTP 400, a reward that raises HTTP 422 (neither is retried by the client), with ``{"error": "<message>"}``. Requests
are read and decoded concurrently (one thread each); at most ``--max-concurrent`` are scored at once (default 1: a
reward model need not be thread-safe). It uses the standard library's ``ThreadingHTTPServer``: bind it to loopback or a
private network, as it has no authentication.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from diffalign.rewards.http import PROTOCOL, decode_images, encode_output

logger = logging.getLogger(__name__)


class RewardServer(ThreadingHTTPServer):
    """Serves one reward over ``diffalign-reward/1`` (see the module docstring).

    Args:
        reward: any reward (`diffalign.rewards.base.Reward`): ``reward(images, prompts, metadata) -> RewardOutput``.
        address (`tuple[str, int]`, defaults to ``("127.0.0.1", 0)``): host and port; port 0 takes a free port
            (read it from `url`).
        name (`str`, *optional*): the name reported by ``/health``; default the reward's ``name``.
        max_concurrent (`int`, defaults to 1): batches scored at once.

    Attributes:
        url (`str`): ``http://<host>:<port>``, the value for ``reward.http.url``.
        requests_scored (`int`): score requests answered with HTTP 200.
    """

    daemon_threads = True

    def __init__(self, reward: Any, address: tuple[str, int] = ("127.0.0.1", 0), *, name: str | None = None,
                 max_concurrent: int = 1):
        if max_concurrent < 1:
            raise ValueError(f"--max-concurrent={max_concurrent} must be >= 1")
        self.reward = reward
        self.reward_name = name or getattr(reward, "name", type(reward).__name__)
        self.slots = threading.Semaphore(max_concurrent)
        self.requests_scored = 0
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "protocol": PROTOCOL, "reward": self.reward_name,
                "modality": getattr(self.reward, "modality", None),
                "differentiable": bool(getattr(self.reward, "differentiable", False))}

    def score(self, request: Any) -> dict[str, Any]:
        """The answer to one decoded score request.

        Raises:
            ValueError: the request is not the protocol (→ HTTP 400).
            _RewardFailed: the reward raised (→ HTTP 422).
        """
        if not isinstance(request, dict):
            raise ValueError("the request must be a JSON object")  # noqa: TRY004 - a bad request (HTTP 400)
        if request.get("protocol") != PROTOCOL:
            raise ValueError(f"protocol {request.get('protocol')!r} is not {PROTOCOL!r}")
        images = decode_images(request.get("images"))
        prompts, metadata = request.get("prompts"), request.get("metadata")
        count = images.shape[0]
        if not isinstance(prompts, list) or len(prompts) != count or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts must be a list of {count} strings, one per image")
        if metadata is not None and (not isinstance(metadata, list) or len(metadata) != count):
            raise ValueError(f"metadata must be null or a list of {count} entries, one per image")
        with self.slots, torch.no_grad():
            try:
                out = self.reward(images, prompts, metadata)
            except Exception as err:
                logger.exception("reward %r raised on a batch of %d", self.reward_name, count)
                raise _RewardFailed(f"reward {self.reward_name!r} raised {type(err).__name__}: {err}") from err
        scores = getattr(out, "scores", None)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (count,):
            shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(out).__name__
            raise _RewardFailed(f"reward {self.reward_name!r} returned scores of shape {shape}, expected ({count},)")
        self.requests_scored += 1
        return encode_output(out, count)


class _RewardFailed(RuntimeError):
    """The served reward raised or returned something unusable (HTTP 422)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connection
    server: RewardServer

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._answer(HTTPStatus.OK, self.server.health())
        else:
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}; GET /health or POST /score"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}; POST /score or GET /health"})
            return
        length = self.headers.get("Content-Length")
        if length is None:
            self._answer(HTTPStatus.LENGTH_REQUIRED, {"error": "a score request needs a Content-Length"})
            return
        try:
            request = json.loads(self.rfile.read(int(length)))
            answer = self.server.score(request)
        except _RewardFailed as err:
            self._answer(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(err)})
        except ValueError as err:  # includes json.JSONDecodeError
            self._answer(HTTPStatus.BAD_REQUEST, {"error": f"bad request: {err}"})
        else:
            self._answer(HTTPStatus.OK, answer)


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["field=value", ...]`` → ``{field: value}`` with YAML-typed values (as Hydra overrides: ``2`` is an int,
    ``[0,1]`` a list, ``cuda`` a string).

    Raises:
        ValueError: an item is not ``field=value``.
    """
    from omegaconf import OmegaConf

    bad = [item for item in overrides if "=" not in item or not item.partition("=")[0]]
    if bad:
        raise ValueError(f"reward settings must be field=value (e.g. score=binary); got {bad}")
    return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``diffalign-reward-server REWARD [field=value ...] [--host H] [--port P] [--max-concurrent N]``: builds the
    installed reward plugin `REWARD` with its config fields overridden and serves it until interrupted.

    With ``--template`` it prints `diffalign.rewards.standalone_server` (a server without diffalign) instead.

    Returns:
        The exit status: 0 after Ctrl-C (or ``--template``), 2 when the reward cannot be built or the address cannot be
        bound (the message names the cause).
    """
    parser = argparse.ArgumentParser(
        prog="diffalign-reward-server",
        description="Serve an installed diffalign reward over HTTP (protocol diffalign-reward/1; POST /score, GET "
                    "/health) for reward=[http] reward.http.url=http://HOST:PORT. See docs/guides/rewards.md.")
    parser.add_argument("reward", nargs="?", help="an installed reward (e.g. geneval_shapes, brightness, clip_score) "
                                                  "or python:<module>:<function>")
    parser.add_argument("overrides", nargs="*", metavar="field=value", help="the reward's config fields")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 takes a free one)")
    parser.add_argument("--max-concurrent", type=int, default=1, help="batches scored at once (default 1)")
    parser.add_argument("--template", action="store_true",
                        help="print a one-file server that needs only numpy and pillow (no diffalign), to adapt in "
                             "your reward model's own environment, and exit")
    args = parser.parse_args(argv)
    if args.template:
        from diffalign.rewards import standalone_server

        with open(standalone_server.__file__, encoding="utf-8") as f:
            sys.stdout.write(f.read())
        return 0
    if args.reward is None:
        parser.error("name the reward to serve (e.g. diffalign-reward-server brightness), or pass --template")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from diffalign.plugins import build_reward

    try:
        reward = build_reward(args.reward, **parse_overrides(args.overrides))
        server = RewardServer(reward, (args.host, args.port), name=args.reward, max_concurrent=args.max_concurrent)
    except Exception as err:  # noqa: BLE001 - reported as one line, the cause named
        cause = err.__cause__ or err
        print(f"diffalign-reward-server: error: cannot serve {args.reward!r}: {type(cause).__name__}: {cause}",
              file=sys.stderr)
        return 2
    print(f"[diffalign] serving reward {args.reward!r} ({type(reward).__name__}) at {server.url} (POST /score, GET "
          f"/health; {PROTOCOL}); use reward=[http] reward.http.url={server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
