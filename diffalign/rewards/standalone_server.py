"""A reward server for diffalign's ``reward=[http]`` in one file that does not import diffalign or torch: copy it into
the environment of your reward model (mmdet for GenEval, an OCR engine, a vLLM judge...), replace `score`, and run

    python standalone_server.py --port 8000
    diffalign-train ... reward=[http] reward.http.url=http://HOST:8000     # in the training environment

(``diffalign-reward-server --template > standalone_server.py`` writes this file.) It needs Python >= 3.8, numpy and
pillow, and speaks the protocol ``diffalign-reward/1`` of docs/guides/rewards.md#rewards-served-over-http: ``GET
/health`` and ``POST /score`` with JSON bodies; images arrive as base64 PNGs (``reward.http.image_format=png``, the
default) or raw uint8 / float32 arrays. The example `score` is the mean luma of each image, so it runs as it is.
Requests over the limits below (body, batch, pixels, prompt length) get HTTP 413, malformed ones 400, before anything
is decoded; a connection silent for IDLE_TIMEOUT seconds is closed.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

PROTOCOL = "diffalign-reward/1"
NAME = "mean_luma"  # what /health reports


def score(images: np.ndarray, prompts: list, metadata: list | None) -> dict:
    """Scores one batch. Replace this with your reward model.

    Args:
        images: uint8 `(B, H, W, 3)` RGB images (videos: `(B, F, H, W, 3)`), the layout PIL, OpenCV and mmdet read
            (``Image.fromarray(images[i])``); float32 in [0, 1] when the client sends ``image_format=float32``.
        prompts: the `B` prompts.
        metadata: `B` per-sample JSON records (e.g. GenEval's ``include`` constraints), or None.

    Returns:
        ``{"scores": [B floats, higher is better; None for a sample you could not score, which stops the training
        run], "info": {key: [B JSON values]} (optional, e.g. "correct": [B booleans] for a verifier),
        "maps": float32 array (B, H, W) (optional, dense per-pixel scores)}``.
    """
    pixels = images.astype(np.float64) / (255.0 if images.dtype == np.uint8 else 1.0)
    luma = pixels @ np.array([0.299, 0.587, 0.114])  # (B, [F,] H, W)
    return {"scores": luma.reshape(len(luma), -1).mean(axis=1).tolist()}


# ---------------------------------------------------------------------------------------- the protocol (keep as is)
# What one request may cost (over a limit: HTTP 413 before anything is decoded; docs/guides/rewards.md#server-limits).

MAX_BODY_BYTES = 512 * 2**20     # request body
MAX_BATCH_SIZE = 256             # samples (images or videos) per request
MAX_IMAGE_PIXELS = 4096 * 4096   # height x width of one image or frame, declared in `shape` and in each PNG's header
MAX_BATCH_PIXELS = 2**26         # pixels per request, frames included
MAX_PROMPT_CHARS = 10_000        # characters per prompt
READ_TIMEOUT = 120.0             # seconds to receive a whole body (HTTP 408)
IDLE_TIMEOUT = 60.0              # seconds a connection may stay silent (then closed: a stalled upload frees a thread)
MAX_ERROR_CHARS = 500            # longest error message answered

_DTYPES = {"uint8": np.dtype("u1"), "float32": np.dtype("<f4")}


class Refused(Exception):
    """A request answered with `status` (400 malformed, 408 too slow, 411 no length, 413 over a limit)."""

    def __init__(self, status: int, message: str):
        super().__init__(clip(message))
        self.status = status


def clip(text, limit: int = MAX_ERROR_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def check_request(request) -> list:
    """The image batch's shape after the checks that need no decoding (protocol, shape, limits, prompts)."""
    if not isinstance(request, dict) or request.get("protocol") != PROTOCOL:
        raise Refused(400, f"the request must be a JSON object with protocol {PROTOCOL!r}")
    obj = request.get("images")
    if not isinstance(obj, dict) or obj.get("format") not in ("png", *_DTYPES):
        raise Refused(400, "images must be an object with format png, uint8 or float32")
    shape = obj.get("shape")
    if (not isinstance(shape, list) or len(shape) not in (4, 5) or shape[-3] != 3
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)):
        raise Refused(400, f"images.shape must be [B, 3, H, W] or [B, F, 3, H, W] of integers >= 1; got {shape}")
    frames, pixels = int(np.prod(shape[:-3])), shape[-2] * shape[-1]
    if shape[0] > MAX_BATCH_SIZE or pixels > MAX_IMAGE_PIXELS or frames * pixels > MAX_BATCH_PIXELS:
        raise Refused(413, f"images.shape {shape} is over this server's limits ({MAX_BATCH_SIZE} samples, "
                           f"{MAX_IMAGE_PIXELS} pixels per image, {MAX_BATCH_PIXELS} per request)")
    prompts, metadata = request.get("prompts"), request.get("metadata")
    if not isinstance(prompts, list) or len(prompts) != shape[0] or not all(isinstance(p, str) for p in prompts):
        raise Refused(400, f"prompts must be a list of {shape[0]} strings")
    if any(len(p) > MAX_PROMPT_CHARS for p in prompts):
        raise Refused(413, f"a prompt is longer than this server's {MAX_PROMPT_CHARS} characters")
    if metadata is not None and (not isinstance(metadata, list) or len(metadata) != shape[0]):
        raise Refused(400, f"metadata must be null or a list of {shape[0]} entries")
    return shape


def decode_images(obj: dict, shape: list) -> np.ndarray:
    """An image batch object → `(B, H, W, 3)` (or `(B, F, H, W, 3)`) uint8 (png, uint8) or float32 (float32); each
    PNG's header is checked before its pixels are decompressed, and float pixels must be finite, in [0, 1]."""
    height, width = shape[-2], shape[-1]
    if obj["format"] == "png":
        data = obj.get("data")
        if not isinstance(data, list) or len(data) != int(np.prod(shape[:-3])):
            raise Refused(400, f"images.data must be a list of {int(np.prod(shape[:-3]))} base64 PNGs")
        frames = []
        for k, item in enumerate(data):
            try:
                image = Image.open(io.BytesIO(base64.b64decode(item, validate=True)), formats=["PNG"])  # header only
            except Exception as err:  # noqa: BLE001
                raise Refused(400, f"images.data[{k}] is not a base64 PNG: {err}") from None
            if image.size != (width, height):
                raise Refused(413 if image.size[0] * image.size[1] > MAX_IMAGE_PIXELS else 400,
                              f"images.data[{k}]'s header declares {image.size[0]}x{image.size[1]} px, shape says "
                              f"{width}x{height}; not decoded")
            try:
                frames.append(np.asarray(image.convert("RGB")))
            except Exception as err:  # noqa: BLE001 - a truncated or corrupt PNG
                raise Refused(400, f"images.data[{k}] is not a decodable PNG: {err}") from None
        return np.stack(frames).reshape(shape[:-3] + [height, width, 3])
    dtype, data = _DTYPES[obj["format"]], obj.get("data")
    size = int(np.prod(shape)) * dtype.itemsize
    if not isinstance(data, str) or len(data) != 4 * -(-size // 3):
        raise Refused(400, f"images.data must be the base64 of {size} bytes for shape {shape}")
    try:
        raw = np.frombuffer(base64.b64decode(data, validate=True), dtype=dtype).reshape(shape)
    except ValueError as err:
        raise Refused(400, f"images.data is not base64: {err}") from None
    if raw.dtype == np.float32 and not (np.isfinite(raw).all() and raw.min() >= 0 and raw.max() <= 1):
        raise Refused(400, "images hold non-finite values or values outside [0, 1]")
    return np.moveaxis(raw, -3, -1)  # channels last


def encode_answer(result: dict, count: int) -> dict:
    """`score`'s result → the JSON answer (non-finite scores become null; maps a float32 array object)."""
    scores = [None if s is None or not np.isfinite(s) else float(s) for s in result["scores"]]
    if len(scores) != count:
        raise ValueError(f"score returned {len(scores)} scores for {count} images")
    maps = result.get("maps")
    if maps is not None:
        maps = np.ascontiguousarray(maps, dtype="<f4")
        maps = {"format": "float32", "shape": list(maps.shape), "data": base64.b64encode(maps.tobytes()).decode()}
    return {"scores": scores, "maps": maps, "info": result.get("info") or {}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT  # every read waits at most this long
    lock = threading.Lock()  # one batch at a time: most models are not thread-safe

    def answer(self, status: int, payload: dict, close: bool = False) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:  # (an unread body must not be taken for the next request)
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message=None, explain=None) -> None:  # http.server's own refusals, as JSON
        self.request_version = "HTTP/1.1"  # (an unreadable request line counts as HTTP/0.9: no status line)
        self.answer(code, {"error": clip(message or "bad request")}, close=True)

    def log_message(self, format: str, *args) -> None:
        super().log_message("%s", clip(format % args, 300))

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self.answer(200, {"status": "ok", "protocol": PROTOCOL, "reward": NAME})
        else:
            self.answer(404, {"error": "GET /health or POST /score"})

    def read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or self.headers.get("Transfer-Encoding"):
            raise Refused(411, "send a Content-Length (chunked bodies are not read)")
        if not length.strip().isdigit():
            raise Refused(400, "Content-Length is not a number of bytes")
        if int(length) > MAX_BODY_BYTES:
            raise Refused(413, f"a body of {length} bytes is over this server's {MAX_BODY_BYTES}")
        chunks, received, deadline = [], 0, time.monotonic() + READ_TIMEOUT
        while received < int(length):
            if time.monotonic() > deadline:
                raise Refused(408, f"the body was not received within {READ_TIMEOUT:g} s")
            try:
                chunk = self.rfile.read1(min(int(length) - received, 1 << 20))
            except OSError:  # socket.timeout (an OSError before Python 3.10)
                raise Refused(408, "the body stalled") from None
            if not chunk:
                raise Refused(400, "the connection ended before the body")
            chunks.append(chunk)
            received += len(chunk)
        return b"".join(chunks)

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self.answer(404, {"error": "GET /health or POST /score"}, close=True)
            return
        try:
            try:
                request = json.loads(self.read_body())
            except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deeply
                raise Refused(400, f"the body is not JSON: {type(err).__name__}: {err}") from None
            shape = check_request(request)
            images = decode_images(request["images"], shape)
        except Refused as err:
            self.answer(err.status, {"error": f"bad request: {err}"}, close=err.status != 400)
            return
        except Exception as err:  # noqa: BLE001 - a malformed request: 400, not retried by the client
            self.answer(400, {"error": clip(f"bad request: {type(err).__name__}: {err}")})
            return
        try:
            with self.lock:
                result = score(images, request["prompts"], request.get("metadata"))
            answer = encode_answer(result, len(images))
        except Exception as err:  # noqa: BLE001 - the reward failed: 422, not retried; the run stops naming it
            self.answer(422, {"error": clip(f"{type(err).__name__}: {err}")})
            return
        self.answer(200, answer)


def make_server(host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"a {PROTOCOL} reward server ({NAME})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port)
    print(f"serving {NAME} at http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
