"""``diffalign-reward-server``: the reference server of the ``diffalign-reward/1`` protocol (`diffalign.rewards.http`).

It serves any installed reward plugin (or a ``python:<module>:<function>`` one-off) by name, with its config fields
given as ``field=value``, so a reward whose dependencies cannot live in the training environment runs in its own::

    diffalign-reward-server geneval_shapes score=binary --host 127.0.0.1 --port 8000
    diffalign-train recipe=tiny_ddpo reward=[http] reward.http.url=http://127.0.0.1:8000

Endpoints: ``GET /health`` → ``{"status": "ok", "protocol", "reward", "modality", "differentiable", "limits"}``;
``POST /score`` (the request and answer of docs/guides/rewards.md#rewards-served-over-http). Every answer is JSON, errors
``{"error": "<message>"}`` with the message cut to `MAX_ERROR_CHARS`: HTTP 400 for a request that is not the
protocol (malformed JSON or shapes, non-finite pixels...), 413 for one over a limit (`ServerLimits`: body bytes,
samples, pixels per image as declared and as in each PNG's header, pixels per batch, prompt length; checked before
anything is decoded), 408 for a body not received within ``read_timeout``, 411 without a Content-Length, 422 when the
reward raises, 503 when ``max_connections`` are open. A connection silent for ``idle_timeout`` is closed, so a stalled
upload frees its thread. Requests are read and decoded concurrently (one thread each); at most ``--max-concurrent``
are scored at once (default 1: a reward model need not be thread-safe). It has no authentication: bind it to loopback
or a private network.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from diffalign.rewards.http import (
    IMAGE_FORMATS,
    PROTOCOL,
    ImageTooLarge,
    check_image_shape,
    decode_images,
    encode_output,
)
from diffalign.runtime.console import quiet_on_broken_pipe

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 500
"""Longest error message answered or logged (a request's own text, e.g. a 5 MB prompt, is never echoed whole)."""


@dataclass(frozen=True)
class ServerLimits:
    """What one request may cost the server (``diffalign-reward-server --max-body-mb ... --idle-timeout ...``).

    The defaults admit the client's defaults with room to spare (``reward.http.max_batch_size=16`` images of
    1024 × 1024 as float32 is 268 MB of base64 and 16.8 M pixels; 16 videos of 16 frames of 512 × 512 is 67 M pixels)
    and bound a request's memory to about 3.5 GB (the body, its JSON, and ``max_batch_pixels`` float32 RGB pixels).

    Attributes:
        max_body_bytes (`int`, defaults to 512 MiB): request body size (HTTP 413 before it is read).
        max_batch_size (`int`, defaults to 256): samples (images or videos) per request (413).
        max_image_pixels (`int`, defaults to 4096²): height × width of one image or frame, as the request's ``shape``
            declares and as each PNG's header declares (413 before any pixel is decompressed).
        max_batch_pixels (`int`, defaults to 2²⁶ = 67 M): pixels of the whole batch, frames included (413).
        max_prompt_chars (`int`, defaults to 10,000): characters per prompt (413).
        read_timeout (`float`, defaults to 120): seconds to receive a whole body (408, connection closed).
        idle_timeout (`float`, defaults to 60): seconds a connection may stay silent: before its request line, between
            keep-alive requests, within a body (the connection is closed).
        max_connections (`int`, defaults to 64): connections served at once (one thread each); more get HTTP 503,
            which the client retries.
    """

    max_body_bytes: int = 512 * 2**20
    max_batch_size: int = 256
    max_image_pixels: int = 4096 * 4096
    max_batch_pixels: int = 2**26
    max_prompt_chars: int = 10_000
    read_timeout: float = 120.0
    idle_timeout: float = 60.0
    max_connections: int = 64

    def __post_init__(self):
        for limit in dataclasses.fields(self):
            value = getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"--{limit.name.replace('_', '-')}={value!r} must be a number > 0")


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was (for errors and logs that quote a request)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RequestRefused(ValueError):
    """A request the server does not score: `status` (400, 408, 411, 413) and the message answered (a ValueError, as
    the server's refusals were)."""

    def __init__(self, status: int, message: str):
        super().__init__(clip(message))
        self.status = status


class RewardServer(ThreadingHTTPServer):
    """Serves one reward over ``diffalign-reward/1`` (see the module docstring).

    Args:
        reward: any reward (`diffalign.rewards.base.Reward`): ``reward(images, prompts, metadata) -> RewardOutput``.
        address (`tuple[str, int]`, defaults to ``("127.0.0.1", 0)``): host and port; port 0 takes a free port
            (read it from `url`).
        name (`str`, *optional*): the name reported by ``/health``; default the reward's ``name``.
        max_concurrent (`int`, defaults to 1): batches scored at once.
        limits (`ServerLimits`, *optional*): what one request may cost; default `ServerLimits()`.

    Attributes:
        url (`str`): ``http://<host>:<port>``, the value for ``reward.http.url``.
        requests_scored (`int`): score requests answered with HTTP 200.
    """

    daemon_threads = True

    def __init__(self, reward: Any, address: tuple[str, int] = ("127.0.0.1", 0), *, name: str | None = None,
                 max_concurrent: int = 1, limits: ServerLimits | None = None):
        if max_concurrent < 1:
            raise ValueError(f"--max-concurrent={max_concurrent} must be >= 1")
        self.reward = reward
        self.reward_name = name or getattr(reward, "name", type(reward).__name__)
        self.slots = threading.Semaphore(max_concurrent)
        self.limits = limits or ServerLimits()
        self.connections = threading.BoundedSemaphore(self.limits.max_connections)
        self.requests_scored = 0
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """One thread per connection, at most ``limits.max_connections``; above, an immediate HTTP 503."""
        if not self.connections.acquire(blocking=False):
            body = json.dumps({"error": f"the server has {self.limits.max_connections} connections open "
                                        "(--max-connections); retry later"}).encode()
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "protocol": PROTOCOL, "reward": self.reward_name,
                "modality": getattr(self.reward, "modality", None),
                "differentiable": bool(getattr(self.reward, "differentiable", False)),
                "limits": dataclasses.asdict(self.limits)}

    def check_request(self, request: Any) -> tuple[list[str], list | None]:
        """The prompts and metadata of a score request, after every check that needs no decoding: the protocol, the
        image batch's ``format`` and ``shape`` against the limits, the prompts and metadata against the batch size.

        Raises:
            RequestRefused: 400 (not the protocol) or 413 (over a limit), naming the field.
        """
        if not isinstance(request, dict):
            raise RequestRefused(400, "the request must be a JSON object")
        if request.get("protocol") != PROTOCOL:
            raise RequestRefused(400, f"protocol {clip(repr(request.get('protocol')), 100)} is not {PROTOCOL!r}")
        images, limits = request.get("images"), self.limits
        if not isinstance(images, dict) or images.get("format") not in IMAGE_FORMATS:
            raise RequestRefused(400, f"images must be an object with format one of {IMAGE_FORMATS}")
        try:
            shape = check_image_shape(images.get("shape"))
        except ValueError as err:
            raise RequestRefused(400, str(err)) from None
        count, height, width = shape[0], shape[-2], shape[-1]
        if count > limits.max_batch_size:
            raise RequestRefused(413, f"images.shape {shape}: {count} samples, over this server's --max-batch-size "
                                      f"{limits.max_batch_size}; lower reward.http.max_batch_size")
        if height * width > limits.max_image_pixels:
            raise RequestRefused(413, f"images.shape {shape}: {height}x{width} = {height * width} pixels per image, "
                                      f"over this server's --max-image-pixels {limits.max_image_pixels}")
        if math.prod(shape[:-3]) * height * width > limits.max_batch_pixels:
            raise RequestRefused(413, f"images.shape {shape}: {math.prod(shape[:-3]) * height * width} pixels in "
                                      f"the batch, over this server's --max-batch-pixels {limits.max_batch_pixels}; "
                                      "lower reward.http.max_batch_size")
        prompts, metadata = request.get("prompts"), request.get("metadata")
        if not isinstance(prompts, list) or len(prompts) != count or not all(isinstance(p, str) for p in prompts):
            raise RequestRefused(400, f"prompts must be a list of {count} strings, one per image")
        longest = max((len(p) for p in prompts), default=0)
        if longest > limits.max_prompt_chars:
            raise RequestRefused(413, f"a prompt of {longest} characters, over this server's --max-prompt-chars "
                                      f"{limits.max_prompt_chars}")
        if metadata is not None and (not isinstance(metadata, list) or len(metadata) != count):
            raise RequestRefused(400, f"metadata must be null or a list of {count} entries, one per image")
        return prompts, metadata

    def decode(self, request: dict[str, Any]) -> torch.Tensor:
        """The request's pixels, float32 in [0, 1] (`decode_images`, each PNG's header checked first).

        Raises:
            RequestRefused: 400 for undecodable or non-finite pixels, or values outside [0, 1]; 413 for a PNG whose
                header declares more than ``max_image_pixels``.
        """
        try:
            pixels = decode_images(request["images"], max_image_pixels=self.limits.max_image_pixels)
        except ImageTooLarge as err:
            raise RequestRefused(413, f"{err} (--max-image-pixels)") from None
        except ValueError as err:
            raise RequestRefused(400, str(err)) from None
        finite = torch.isfinite(pixels)
        if not finite.all():
            raise RequestRefused(400, f"images hold {int((~finite).sum())} non-finite values (NaN or inf); send "
                                      "decoded images in [0, 1]")
        if pixels.numel() and (pixels.min() < 0 or pixels.max() > 1):
            raise RequestRefused(400, f"image values span [{float(pixels.min()):g}, {float(pixels.max()):g}]; the "
                                      "protocol's pixels are in [0, 1]")
        return pixels

    def score(self, request: Any) -> dict[str, Any]:
        """The answer to one decoded score request.

        Raises:
            RequestRefused: the request is not the protocol (→ HTTP 400) or is over a limit (→ 413).
            _RewardFailed: the reward raised (→ HTTP 422).
        """
        prompts, metadata = self.check_request(request)
        images = self.decode(request)
        count = images.shape[0]
        with self.slots, torch.no_grad():
            try:
                out = self.reward(images, prompts, metadata)
            except Exception as err:
                logger.error("reward %r raised on a batch of %d:\n%s", self.reward_name, count, _short_traceback(err))
                raise _RewardFailed(f"reward {self.reward_name!r} raised {type(err).__name__}: {err}") from err
        scores = getattr(out, "scores", None)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (count,):
            shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(out).__name__
            raise _RewardFailed(f"reward {self.reward_name!r} returned scores of shape {shape}, expected ({count},)")
        try:
            answer = encode_output(out, count)
        except Exception as err:
            raise _RewardFailed(f"reward {self.reward_name!r} returned an output that cannot be sent: "
                                f"{type(err).__name__}: {err}") from err
        self.requests_scored += 1
        return answer


def _short_traceback(err: BaseException, line_chars: int = 300, max_lines: int = 60) -> str:
    """`err`'s traceback with every line cut to `line_chars` and at most the last `max_lines` lines."""
    lines = "".join(traceback.format_exception(err)).splitlines()[-max_lines:]
    return "\n".join(clip(line, line_chars) for line in lines)


class _RewardFailed(RuntimeError):
    """The served reward raised or returned something unusable (HTTP 422)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client reuses its connection
    server: RewardServer

    def setup(self) -> None:
        self.timeout = self.server.limits.idle_timeout  # every read waits at most this long (StreamRequestHandler)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), clip(format % args, 300))

    def _answer(self, status: int, payload: dict[str, Any], *, close: bool = False) -> None:
        if "error" in payload:
            payload = {**payload, "error": clip(payload["error"])}
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line or header, an over-long URI, an unknown method) as
        JSON, like every other answer, and the connection closed (with a status line and headers even when the
        request line was unreadable, which http.server takes for HTTP/0.9 and would answer with a bare body)."""
        self.request_version = "HTTP/1.1"
        try:
            short, _ = self.responses[code]
        except KeyError:
            short = "error"
        self._answer(code, {"error": f"{message or short}{f': {explain}' if explain else ''}"}, close=True)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self._answer(HTTPStatus.OK, self.server.health())
        else:
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no {clip(self.path, 100)}; GET /health or POST /score"})

    def _not_allowed(self) -> None:
        self._answer(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{self.command} is not served; GET /health or POST "
                                                              "/score"}, close=True)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed

    def _read_body(self) -> bytes:
        """The request body, at most ``limits.max_body_bytes``, within ``limits.read_timeout`` seconds.

        Raises:
            RequestRefused: 411 (no Content-Length, or chunked), 400 (a bad one), 413 (too long), 408 (too slow).
        """
        limits = self.server.limits
        if self.headers.get("Transfer-Encoding"):
            raise RequestRefused(411, "chunked bodies are not read; send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestRefused(411, "a score request needs a Content-Length")
        if not length.strip().isdigit():
            raise RequestRefused(400, f"Content-Length {clip(length, 40)!r} is not a number of bytes")
        size = int(length)
        if size > limits.max_body_bytes:
            raise RequestRefused(413, f"a body of {size} bytes, over this server's --max-body-mb "
                                      f"{limits.max_body_bytes / 2**20:g} MiB; lower reward.http.max_batch_size")
        deadline, chunks, received = time.monotonic() + limits.read_timeout, [], 0
        while received < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestRefused(408, f"the body was not received within --read-timeout {limits.read_timeout:g} s "
                                          f"({received} of {size} bytes)")
            self.connection.settimeout(min(remaining, limits.idle_timeout))
            try:
                chunk = self.rfile.read1(min(size - received, 1 << 20))
            except TimeoutError:
                raise RequestRefused(408, f"the body stalled ({received} of {size} bytes received)") from None
            if not chunk:
                raise RequestRefused(400, f"the connection ended after {received} of {size} bytes")
            chunks.append(chunk)
            received += len(chunk)
        self.connection.settimeout(limits.idle_timeout)
        return b"".join(chunks)

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self._answer(HTTPStatus.NOT_FOUND, {"error": f"no {clip(self.path, 100)}; POST /score or GET /health"},
                         close=True)
            return
        try:
            body = self._read_body()
            try:
                request = json.loads(body)
            except RecursionError:
                raise RequestRefused(400, "the JSON is nested too deeply") from None
            except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError, an integer of 5000 digits
                raise RequestRefused(400, f"the body is not JSON: {err}") from None
            answer = self.server.score(request)
        except RequestRefused as err:
            # a body left unread (413, 411, 408) would be taken for the next request: close the connection then
            self._answer(err.status, {"error": f"bad request: {err}" if err.status == 400 else str(err)},
                         close=err.status != 400)
        except _RewardFailed as err:
            self._answer(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(err)})
        except Exception as err:  # noqa: BLE001 - a request no check foresaw: a 400 naming it, no dropped connection
            logger.error("unforeseen error on a score request:\n%s", _short_traceback(err))
            self._answer(HTTPStatus.BAD_REQUEST, {"error": f"bad request: {type(err).__name__}: {err}"})
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


@quiet_on_broken_pipe
def main(argv: Sequence[str] | None = None) -> int:
    """``diffalign-reward-server REWARD [field=value ...] [--host H] [--port P] [--max-concurrent N] [limits]``: builds
    the installed reward plugin `REWARD` with its config fields overridden and serves it until interrupted, each
    request within `ServerLimits` (``--max-body-mb``, ``--max-batch-size``, ``--max-image-pixels``,
    ``--max-batch-pixels``, ``--max-prompt-chars``, ``--read-timeout``, ``--idle-timeout``, ``--max-connections``).

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
    defaults = ServerLimits()
    limits = parser.add_argument_group("limits", "what one request may cost; over them a request gets HTTP 413 (408 "
                                                 "for a slow body) before anything is decoded")
    limits.add_argument("--max-body-mb", type=float, default=defaults.max_body_bytes / 2**20,
                        help="request body size in MiB (default %(default)g)")
    limits.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size,
                        help="samples (images or videos) per request (default %(default)d)")
    limits.add_argument("--max-image-pixels", type=int, default=defaults.max_image_pixels,
                        help="height x width of one image or frame (default %(default)d = 4096^2)")
    limits.add_argument("--max-batch-pixels", type=int, default=defaults.max_batch_pixels,
                        help="pixels in one request, frames included (default %(default)d = 2^26)")
    limits.add_argument("--max-prompt-chars", type=int, default=defaults.max_prompt_chars,
                        help="characters per prompt (default %(default)d)")
    limits.add_argument("--read-timeout", type=float, default=defaults.read_timeout,
                        help="seconds to receive a whole request body (default %(default)g)")
    limits.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout,
                        help="seconds a connection may stay silent before it is closed (default %(default)g)")
    limits.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="connections served at once; more get HTTP 503 (default %(default)d)")
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

    from diffalign.rewards.reward_set import build_reward

    try:
        limits = ServerLimits(max_body_bytes=int(args.max_body_mb * 2**20), max_batch_size=args.max_batch_size,
                              max_image_pixels=args.max_image_pixels, max_batch_pixels=args.max_batch_pixels,
                              max_prompt_chars=args.max_prompt_chars, read_timeout=args.read_timeout,
                              idle_timeout=args.idle_timeout, max_connections=args.max_connections)
    except ValueError as err:
        parser.error(str(err))
    try:
        reward = build_reward(args.reward, **parse_overrides(args.overrides))
        server = RewardServer(reward, (args.host, args.port), name=args.reward, max_concurrent=args.max_concurrent,
                              limits=limits)
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
