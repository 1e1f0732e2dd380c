"""The reward servers as public services (issue 32, item 2): every request over a limit or malformed gets a 4xx JSON
answer, never a dropped connection; a stalled upload frees its thread; nothing is decoded before the limits are
checked; errors and logs are cut short; non-finite pixels are refused. After every request the server still answers
``/health``. Real servers on 127.0.0.1, real sockets; every loop is bounded."""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from diffalign.rewards import standalone_server
from diffalign.rewards.brightness import Brightness
from diffalign.rewards.http import PROTOCOL, encode_images
from diffalign.rewards.server import MAX_ERROR_CHARS, RewardServer, ServerLimits

IMAGES = torch.rand(2, 3, 8, 8)


class Served:
    """A server (`RewardServer`, or the standalone template's) serving in a thread on a free loopback port."""

    def __init__(self, server):
        self.server = server
        self.port = server.server_address[1]
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    started = []

    def start(kind: str = "diffalign", reward=None, **limits):
        if kind == "standalone":
            server = standalone_server.make_server("127.0.0.1", 0)
        else:
            server = RewardServer(reward or Brightness(), ("127.0.0.1", 0), name="brightness",
                                  limits=ServerLimits(**limits))
        started.append(Served(server))
        return started[-1]

    yield start
    for served in started:
        served.close()


def exchange(port: int, raw: bytes, *, timeout: float = 20.0) -> tuple[int, dict, dict]:
    """Sends `raw` bytes on a new connection and reads one HTTP answer: (status, headers, JSON body).

    Raises:
        AssertionError: when the server closed the connection without an answer, or the body is not JSON.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
        except (http.client.RemoteDisconnected, ConnectionResetError) as err:
            raise AssertionError(f"the connection was dropped without an answer: {err!r}") from None
        body = response.read()
        assert response.getheader("Content-Type") == "application/json", (response.status, body[:200])
        return response.status, dict(response.getheaders()), json.loads(body)


def post(port: int, body: bytes, *, headers: dict | None = None, **kwargs) -> tuple[int, dict, dict]:
    head = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
            **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items() if v is not None)
    return exchange(port, f"POST /score HTTP/1.1\r\n{lines}\r\n".encode() + body, **kwargs)


def request(images: dict | None = None, prompts=None, **extra) -> bytes:
    images = images if images is not None else encode_images(IMAGES, "png")
    shape = images.get("shape")
    count = shape[0] if isinstance(shape, list) and shape and type(shape[0]) is int and 0 <= shape[0] < 1000 else 2
    body = {"protocol": PROTOCOL, "prompts": prompts if prompts is not None else ["a"] * count, "metadata": None,
            "images": images, **extra}
    return json.dumps(body).encode()


def healthy(port: int) -> bool:
    status, _, answer = exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return status == 200 and answer["status"] == "ok"


def png_header_only(width: int, height: int, payload: int = 1000) -> bytes:
    """A PNG whose IHDR declares `width` x `height` RGB pixels, followed by `payload` zero bytes of deflated data
    (far fewer than the declared image): Pillow's ``Image.open`` reads the IHDR only."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * payload))
            + chunk(b"IEND", b""))


def jpeg(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, "JPEG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def raw_float32(value: float) -> dict:
    """A float32 image batch of IMAGES' shape, every pixel `value`."""
    return {"format": "float32", "shape": list(IMAGES.shape), "data": b64(np.full(IMAGES.shape, value, "<f4").tobytes())}


@pytest.fixture
def count_decodes(monkeypatch):
    """The number of images Pillow decoded (``ImageFile.load`` calls) since the fixture started."""
    calls = []
    load = ImageFile.ImageFile.load

    def counted(self):
        calls.append(self.size)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted)
    return calls


# ---------------------------------------------------------------------------------------------------------- limits


def test_the_default_limits_admit_the_clients_defaults():
    """reward.http.max_batch_size=16 images of 1024² as float32 (the largest default request of an image run): the
    body is 4/3 · 16 · 3 · 1024² · 4 bytes of base64, 268 MB."""
    limits = ServerLimits()
    assert 4 * 16 * 3 * 1024**2 * 4 / 3 <= limits.max_body_bytes
    assert 16 <= limits.max_batch_size and 1024**2 <= limits.max_image_pixels
    assert 16 * 16 * 512**2 <= limits.max_batch_pixels  # 16 videos of 16 frames of 512²


@pytest.mark.parametrize("kind", ["diffalign", "standalone"])
def test_a_decompression_bomb_png_is_refused_from_its_header(serve, count_decodes, kind):
    """A 74-byte PNG declaring 8000 x 8000 (192 MB of RGB once decoded; 31 s and 6.2 GB before this fix): refused from
    Pillow's read of its IHDR, before any pixel is decompressed, with HTTP 413 whether `shape` declares the bomb's
    size or a small one; a header within the limit that contradicts `shape` is a 400."""
    served = serve(kind)
    bomb = png_header_only(8000, 8000)
    assert len(bomb) < 2000
    assert Image.open(io.BytesIO(bomb)).size == (8000, 8000)  # the header Pillow reads
    count_decodes.clear()
    for declared in ([1, 3, 8000, 8000], [1, 3, 64, 64]):
        status, _, answer = post(served.port, request({"format": "png", "shape": declared, "data": [b64(bomb)]}))
        assert status == 413, answer
        assert "8000" in answer["error"]
    small = png_header_only(65, 64)  # within the limit, but not the declared 64 x 64
    status, _, answer = post(served.port, request({"format": "png", "shape": [1, 3, 64, 64], "data": [b64(small)]}))
    assert status == 400 and "65x64" in answer["error"]
    assert count_decodes == []  # nothing was decoded
    assert healthy(served.port)


def test_a_png_header_over_the_pixel_limit_is_413_even_when_the_shape_agrees(serve, count_decodes):
    served = serve(max_image_pixels=100 * 100)
    for size, expected in ((101, 413), (100, 200)):
        data = [b64(png_header_only(size, size)) if size > 100 else
                encode_images(torch.rand(1, 3, 100, 100))["data"][0]]
        status, _, answer = post(served.port, request({"format": "png", "shape": [1, 3, size, size], "data": data}))
        assert status == expected, answer
    assert set(count_decodes) == {(100, 100)}  # only the image within the limit was decoded


@pytest.mark.parametrize("kind", ["diffalign", "standalone"])
def test_requests_over_the_limits_get_413_before_decoding(serve, count_decodes, kind):
    served = serve(kind)
    limits = ServerLimits()  # (the standalone template's constants are the same defaults)
    assert standalone_server.MAX_BATCH_SIZE == limits.max_batch_size
    assert standalone_server.MAX_BATCH_PIXELS == limits.max_batch_pixels
    cases = {
        "batch size": {"format": "png", "shape": [limits.max_batch_size + 1, 3, 8, 8], "data": []},
        "pixels per image": {"format": "float32", "shape": [1, 3, 4097, 4096], "data": ""},
        "pixels per batch": {"format": "uint8", "shape": [33, 3, 2048, 1024], "data": ""},  # 33 · 2²¹ > 2²⁶
        "pixels per batch of videos": {"format": "png", "shape": [2, 33, 3, 1024, 1024], "data": []},
    }
    for what, images in cases.items():
        status, _, answer = post(served.port, request(images))
        assert status == 413, (what, answer)
    status, _, answer = post(served.port, request(prompts=["x" * (limits.max_prompt_chars + 1), "a"]))
    assert status == 413 and len(answer["error"]) < 600
    assert count_decodes == []
    assert healthy(served.port)


@pytest.mark.parametrize("kind", ["diffalign", "standalone"])
def test_a_body_over_the_limit_is_refused_before_it_is_read(serve, kind):
    """Content-Length over the limit: 413 at once, the body never sent (a server that waited for it would time out
    instead), and the connection closed (an unread body must not be taken for the next request)."""
    served = serve(kind) if kind == "standalone" else serve(max_body_bytes=2**20, idle_timeout=30)
    limit = standalone_server.MAX_BODY_BYTES if kind == "standalone" else 2**20
    status, headers, answer = exchange(served.port, (f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                                     f"{limit + 1}\r\n\r\n").encode() + b"{")
    assert status == 413 and str(limit + 1) in answer["error"]
    assert headers.get("Connection") == "close"  # (a server waiting for the body would have answered 408)
    assert healthy(served.port)


def test_the_limits_are_configurable_and_checked(serve):
    served = serve(max_batch_size=1)
    status, _, answer = post(served.port, request())
    assert status == 413 and "--max-batch-size 1" in answer["error"]
    assert "reward.http.max_batch_size" in answer["error"]
    with pytest.raises(ValueError, match=r"--read-timeout=0 must be a number > 0"):
        ServerLimits(read_timeout=0)
    from diffalign.rewards.server import main

    with pytest.raises(SystemExit):
        main(["brightness", "--max-batch-size", "0"])


# --------------------------------------------------------------------------------------------------------- timeouts


def test_a_stalled_upload_frees_its_thread(serve):
    """With --max-connections 1, a client that sends 10 of 1000 bytes and stops holds the only connection slot: the
    server answers 408 after --idle-timeout (2 s) and closes, and /health then gets through (it would get 503 while the
    thread was pinned)."""
    served = serve(idle_timeout=2.0, read_timeout=30.0, max_connections=1)
    with socket.create_connection(("127.0.0.1", served.port), timeout=20) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n0123456789")
        time.sleep(0.2)
        status, _, answer = exchange(served.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503 and "--max-connections" in answer["error"]  # the slot is taken meanwhile
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 408 and "stalled" in json.loads(response.read())["error"]
    deadline = time.monotonic() + 10
    while not healthy(served.port):  # the thread releases its slot right after answering
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_trickled_upload_is_cut_at_the_read_timeout(serve):
    """One byte every 0.3 s never trips the idle timeout (1 s), but the whole body must arrive within
    --read-timeout (1.5 s): 408, after at most a few more bytes."""
    served = serve(idle_timeout=1.0, read_timeout=1.5)
    with socket.create_connection(("127.0.0.1", served.port), timeout=20) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        sent, answered = 0, False
        sock.settimeout(0.3)
        for _ in range(60):  # at most 18 s
            try:
                sock.sendall(b"0")
                sent += 1
                answer = sock.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            answered = answer.startswith(b"HTTP/1.1 408")
            break
        assert answered and sent < 20, sent
    assert healthy(served.port)


def test_a_silent_connection_is_closed_after_the_idle_timeout(serve):
    served = serve(idle_timeout=0.5, max_connections=1)
    with socket.create_connection(("127.0.0.1", served.port), timeout=20) as sock:
        assert sock.recv(1) == b""  # closed by the server (without the timeout, recv would wait 20 s and raise)
    deadline = time.monotonic() + 10
    while not healthy(served.port):  # the only slot is freed by its thread just after the close, not before the client sees it
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ malformed requests

MALFORMED = {
    "not JSON": b"{not json",
    "not UTF-8": b'{"protocol": "\xff"}',
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "an integer of 5000 digits": b'{"protocol": ' + b"1" * 5000 + b"}",
    "a JSON array": b"[1, 2]",
    "another protocol": json.dumps({"protocol": "x" * 100_000}).encode(),
    "no images": json.dumps({"protocol": PROTOCOL, "prompts": ["a"]}).encode(),
    "shape of strings": request({"format": "png", "shape": ["a", 3, 8, 8], "data": []}),
    "shape of objects": request({"format": "png", "shape": [{}, 3, 8, 8], "data": []}),
    "shape of floats": request({"format": "float32", "shape": [1.5, 3, 8, 8], "data": ""}),
    "shape of booleans": request({"format": "png", "shape": [True, 3, 8, 8], "data": []}),
    "negative shape": request({"format": "float32", "shape": [-1, 3, 8, 8], "data": ""}),
    "zero shape": request({"format": "uint8", "shape": [0, 3, 8, 8], "data": ""}),
    "shape not a list": request({"format": "png", "shape": "2,3,8,8", "data": []}),
    "4 channels": request({"format": "png", "shape": [1, 4, 8, 8], "data": []}),
    "unknown format": request({"format": "jpeg", "shape": [1, 3, 8, 8], "data": []}),
    "data not a list": request({"format": "png", "shape": [1, 3, 8, 8], "data": "abc"}),
    "data item not a string": request({"format": "png", "shape": [1, 3, 8, 8], "data": [{"a": 1}]}),
    "data item not base64": request({"format": "png", "shape": [1, 3, 8, 8], "data": ["***"]}),
    "a JPEG": request({"format": "png", "shape": [1, 3, 8, 8], "data": [b64(jpeg(8, 8))]}),
    "a truncated PNG": request({"format": "png", "shape": [1, 3, 8, 8], "data": [b64(png_header_only(8, 8, 10))]}),
    "raw data too short": request({"format": "float32", "shape": [1, 3, 8, 8], "data": b64(b"\0" * 12)}),
    "raw data not a string": request({"format": "uint8", "shape": [1, 3, 8, 8], "data": [1, 2]}),
    "prompts of numbers": request(prompts=[1, 2]),
    "too few prompts": request(prompts=["a"]),
    "metadata of another length": request(metadata=[{}]),
    "NaN pixels": request(raw_float32(np.nan)),
    "inf pixels": request(raw_float32(np.inf)),
    "pixels above 1": request(raw_float32(2.0)),
}


@pytest.mark.parametrize("kind", ["diffalign", "standalone"])
def test_every_malformed_request_gets_a_400_json_answer(serve, kind):
    served = serve(kind)
    for what, body in MALFORMED.items():
        status, _, answer = post(served.port, body)
        assert status == 400, (what, status, answer)
        assert 0 < len(answer["error"]) <= MAX_ERROR_CHARS + 40, (what, len(answer["error"]))
    assert healthy(served.port)


@pytest.mark.parametrize("kind", ["diffalign", "standalone"])
def test_malformed_http_gets_a_4xx_json_answer(serve, kind):
    served = serve(kind)
    cases = {
        "garbage request line": (b"HELLO\r\n\r\n", 400),
        "a bad HTTP version": (b"GET /health HTTP/9\r\n\r\n", 400),
        "no Content-Length": (b"POST /score HTTP/1.1\r\nHost: x\r\n\r\n", 411),
        "chunked": (b"POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
        "Content-Length not a number": (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        "negative Content-Length": (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
        "a body shorter than its Content-Length": (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 99\r\n\r\n{}",
                                                   None),
        "another path": (b"POST /other HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 404),
        "a 70 KB request line": (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 414),
    }
    for what, (raw, expected) in cases.items():
        if expected is None:  # the client half-closes: the server sees the end of the body early
            with socket.create_connection(("127.0.0.1", served.port), timeout=20) as sock:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                response = http.client.HTTPResponse(sock)
                response.begin()
                assert response.status == 400, what
                assert "error" in json.loads(response.read())
            continue
        status, _, answer = exchange(served.port, raw)
        assert status == expected, (what, status, answer)
        assert "error" in answer
    assert healthy(served.port)


def test_unserved_methods_get_405(serve):
    served = serve()
    for method in ("PUT", "DELETE", "PATCH"):
        status, _, answer = exchange(served.port, f"{method} /score HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                                     .encode())
        assert status == 405 and method in answer["error"]
    assert healthy(served.port)


# ------------------------------------------------------------------------------------------------- errors and logs


class EchoingReward:
    """A reward that raises with the whole first prompt in its message (as many real ones do)."""

    name, modality, differentiable = "echo", "image", False

    def __call__(self, images, prompts, metadata=None):
        raise ValueError(f"cannot score the prompt {prompts[0]!r}")


def test_errors_and_logs_are_cut_short(serve, caplog):
    """A 9,000-character prompt echoed by a raising reward, and a 100,000-character protocol: the answers and every
    log record of the server stay under a few hundred characters per line (a 5 MB prompt grew the log by 215 MB)."""
    served = serve(reward=EchoingReward())
    caplog.set_level(logging.INFO, logger="diffalign.rewards.server")
    status, _, answer = post(served.port, request(prompts=["p" * 9000, "a"]))
    assert status == 422 and answer["error"].startswith("reward 'brightness' raised ValueError: cannot score")
    assert len(answer["error"]) <= MAX_ERROR_CHARS + 40 and "characters)" in answer["error"]
    status, _, answer = post(served.port, MALFORMED["another protocol"])
    assert status == 400 and len(answer["error"]) <= MAX_ERROR_CHARS + 40
    assert caplog.records  # the failure and the requests were logged...
    longest = max(len(line) for record in caplog.records for line in record.getMessage().splitlines())
    assert longest < 1000, longest  # ...each line short
    assert sum(len(record.getMessage()) for record in caplog.records) < 30_000


def test_a_valid_request_is_still_scored_exactly(serve):
    """The checks refuse nothing the client sends: the served Brightness equals the in-process one on float32."""
    served = serve()
    status, _, answer = post(served.port, request(encode_images(IMAGES, "float32")))
    assert status == 200
    assert np.allclose(answer["scores"], Brightness()(IMAGES, ["a", "a"]).scores.numpy(), rtol=0, atol=1e-7)
