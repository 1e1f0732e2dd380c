"""``reward=[http]``: a reward computed by another process, over HTTP
(docs/guides/rewards.md#rewards-served-over-http).

Rewards that cannot share the training environment (GenEval needs mmdet, OCR needs paddle, VLM judges need vLLM) run
as a server in their own environment; this reward posts each batch of images, prompts and metadata to it and reads
the scores (and optional per-pixel maps) back. The wire protocol, ``diffalign-reward/1``, is JSON over HTTP:

- ``GET <url>/health`` → ``{"status": "ok", "protocol": "diffalign-reward/1", "reward": "<name>"}``;
- ``POST <url>/score`` with ``{"protocol", "prompts" [B], "metadata" [B] | null, "images" <image batch>}`` →
  ``{"scores": [B numbers, null = could not score], "maps": <array> | null, "info": {key: [B values]}}``.

An image batch is ``{"format": "png", "shape": [B, 3, H, W], "data": [B base64 PNGs]}`` (videos: shape
``[B, F, 3, H, W]`` and B·F PNGs, sample-major), or a raw array (``"format": "uint8"`` / ``"float32"``, ``"data"`` the
base64 of the C-order little-endian bytes). 8-bit values are ``floor(255 x + 0.5)``. `encode_images`,
`decode_images`, `encode_array` and `decode_array` implement it for both sides; `diffalign.rewards.server` is the
reference server (``diffalign-reward-server``), serving any installed reward plugin.

The client sends at most ``max_batch_size`` images per request and keeps up to ``max_concurrency`` requests in
flight; a request that times out, cannot connect or gets HTTP 408/429/5xx is retried after ``backoff · 2^k`` seconds
(k = 0, 1, ...; at most ``max_backoff``), ``max_retries`` times; then the call fails with `HttpRewardError` naming the
server, which the training loops turn into a stop with a checkpoint (`diffalign.rewards.reward_set`).
`HttpReward.submit` returns a future, so the online loop and the on-policy data preparation score batch k while
sampling batch k + 1 (`diffalign.rewards.reward_set`).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import requests
import torch
from PIL import Image

from diffalign.config.schemas import config_schema
from diffalign.rewards.reward_set import concat_outputs, gather
from diffalign.runtime.console import literal, warn_repeated
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)

PROTOCOL = "diffalign-reward/1"
"""The wire protocol's name and version, sent in every request and health answer."""
IMAGE_FORMATS = ("png", "uint8", "float32")
"""How images travel: 8-bit PNG per image (or frame), or the raw array as uint8 or float32."""
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses that are retried (a busy or restarting server); any other non-200 status fails at once."""
_DTYPES = {"uint8": np.dtype("u1"), "float32": np.dtype("<f4")}


class HttpRewardError(RuntimeError):
    """A reward server could not be reached, timed out on every attempt, refused a batch or answered something that is
    not the protocol; the message starts with ``reward server <url>``. `status`: the HTTP status of a refusal (None
    when there was no answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ImageTooLarge(ValueError):
    """A PNG whose header declares more pixels than the reader allows (`decode_images`); the reference server answers
    it with HTTP 413."""


HEALTH_CONNECT_TIMEOUT = 3.0
"""Seconds the validation's ``GET <url>/health`` waits for a connection (`HttpReward.check_config`)."""
HEALTH_READ_TIMEOUT = 30.0
"""Seconds it then waits for the answer."""
NO_HEALTH_ROUTE = ("reward server {url} has no /health route (HTTP 404): accepted without a health check; the first "
                   "/score request will tell whether it speaks diffalign-reward/1")


# ------------------------------------------------------------------------------------------------- wire format


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """8-bit values ``floor(255 x + 0.5)`` of float pixels `x` in [0, 1] (same shape, uint8), the rounding the
    shapes-world verifier and PIL's ``Image.fromarray((x * 255 + 0.5).astype(uint8))`` idiom use."""
    return (pixels.float().clamp(0, 1) * 255 + 0.5).to(torch.uint8)


def encode_array(array: torch.Tensor | np.ndarray, fmt: str = "float32") -> dict[str, Any]:
    """``{"format", "shape", "data"}``: `array` as base64 of its C-order little-endian bytes in `fmt` ("uint8" or
    "float32"; the values are cast, not rescaled)."""
    values = np.ascontiguousarray(torch.as_tensor(array).detach().cpu().numpy(), dtype=_DTYPES[fmt])
    return {"format": fmt, "shape": list(values.shape), "data": base64.b64encode(values.tobytes()).decode("ascii")}


def decode_array(obj: Any, where: str = "array") -> torch.Tensor:
    """The tensor of an ``{"format": "uint8" | "float32", "shape", "data"}`` object (its dtype, not rescaled).

    Raises:
        ValueError: naming `where`, when the object is malformed or its data do not fill its shape.
    """
    if not isinstance(obj, dict) or obj.get("format") not in _DTYPES or not isinstance(obj.get("shape"), list):
        raise ValueError(f"{where} must be {{'format': 'uint8' | 'float32', 'shape': [...], 'data': base64}}")
    shape = obj["shape"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"{where}.shape must be a list of integers >= 0; got {str(shape)[:100]}")
    dtype, data = _DTYPES[obj["format"]], obj.get("data", "")
    if not isinstance(data, str) or len(data) != 4 * math.ceil(math.prod(shape) * dtype.itemsize / 3):
        length = len(data) if isinstance(data, str) else type(data).__name__
        raise ValueError(f"{where}.data: {length} characters of base64 do not fill shape {str(shape)[:100]} of "
                         f"{obj['format']} ({math.prod(shape) * dtype.itemsize} bytes)")  # checked before decoding
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as err:
        raise ValueError(f"{where}.data is not base64: {err}") from None
    if len(raw) != int(np.prod(shape)) * dtype.itemsize:
        raise ValueError(f"{where}: {len(raw)} bytes of data do not fill shape {shape} of {obj['format']}")
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(shape).copy())


def encode_images(images: torch.Tensor, fmt: str = "png") -> dict[str, Any]:
    """The image batch object of `images` `(B, 3, H, W)` or videos `(B, F, 3, H, W)`, float in [0, 1].

    Args:
        images (`torch.Tensor`): float pixels in [0, 1].
        fmt (`str`): "png" (one base64 8-bit RGB PNG per image, or per frame in sample-major order), "uint8" (the
            raw 8-bit array) or "float32" (the raw float array, exactly).

    Raises:
        ValueError: for another format, another shape, or values that are not finite or outside [0, 1].
    """
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format {fmt!r} must be one of {IMAGE_FORMATS}")
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(f"images must be (B, 3, H, W) or videos (B, F, 3, H, W); got shape {tuple(images.shape)}")
    pixels = images.detach().float().cpu()
    if not torch.isfinite(pixels).all() or (pixels.numel() and (pixels.min() < 0 or pixels.max() > 1)):
        raise ValueError("images must be finite and in [0, 1] (decoded and clamped) to be sent to a reward server")
    if fmt == "float32":
        return encode_array(pixels, "float32")
    if fmt == "uint8":
        return encode_array(to_uint8(pixels), "uint8")
    frames = to_uint8(pixels).flatten(0, -4).permute(0, 2, 3, 1).numpy()  # (B·F, H, W, 3)
    data = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame, mode="RGB").save(buffer, format="PNG", compress_level=1)
        data.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return {"format": "png", "shape": list(pixels.shape), "data": data}


def check_image_shape(shape: Any) -> list[int]:
    """An image batch's ``shape`` as a list of ints: `[B, 3, H, W]` or `[B, F, 3, H, W]`, every entry an integer >= 1.

    Raises:
        ValueError: naming ``images.shape`` and what it got (cut to 100 characters).
    """
    if (not isinstance(shape, list) or len(shape) not in (4, 5)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape) or shape[-3] != 3):
        raise ValueError(f"images.shape must be [B, 3, H, W] or [B, F, 3, H, W] of integers >= 1; got "
                         f"{str(shape)[:100]}")
    return shape


def decode_images(obj: Any, *, max_image_pixels: int | None = None) -> torch.Tensor:
    """Float32 pixels in [0, 1] of an image batch object (8-bit values `v` become ``v / 255``), shaped as its
    ``shape``.

    Each PNG's header is read and checked before its pixels are decompressed: PNG format, the size ``shape`` declares,
    and at most `max_image_pixels` pixels when given (so a small file declaring 8000 × 8000 costs nothing).

    Raises:
        ValueError: naming the field, when the object is malformed (unknown format, a shape that is not
            `(B, 3, H, W)` / `(B, F, 3, H, W)`, PNGs of another size, count or format, data that do not fill the
            shape), or a PNG's header declares more than `max_image_pixels`.
    """
    if not isinstance(obj, dict) or obj.get("format") not in IMAGE_FORMATS:
        raise ValueError(f"images.format must be one of {IMAGE_FORMATS}")
    shape = check_image_shape(obj.get("shape"))
    if obj["format"] != "png":
        pixels = decode_array(obj, "images")
        return pixels.float() / 255 if obj["format"] == "uint8" else pixels
    data, frames_expected = obj.get("data"), math.prod(shape[:-3])
    if not isinstance(data, list) or len(data) != frames_expected:
        raise ValueError(f"images.data must be a list of {frames_expected} base64 PNGs for shape {shape}")
    height, width = shape[-2], shape[-1]
    frames = []
    for k, item in enumerate(data):
        try:
            image = Image.open(io.BytesIO(base64.b64decode(item, validate=True)), formats=["PNG"])  # the header only
        except Exception as err:  # noqa: BLE001 - any undecodable item is a bad request
            raise ValueError(f"images.data[{k}] is not a base64 PNG: {str(err)[:200]}") from None
        declared = image.size[0] * image.size[1]
        if max_image_pixels is not None and declared > max_image_pixels:
            raise ImageTooLarge(f"images.data[{k}]'s PNG header declares {image.size[0]}x{image.size[1]} = {declared} "
                             f"pixels, over the server's limit of {max_image_pixels}; not decoded")
        if image.size != (width, height):
            raise ValueError(f"images.data[{k}] is {image.size[0]}x{image.size[1]} px, shape says {width}x{height}")
        try:
            image.load()
            frames.append(np.asarray(image.convert("RGB")))
        except Exception as err:  # noqa: BLE001 - a truncated or corrupt PNG
            raise ValueError(f"images.data[{k}] is not a decodable PNG: {str(err)[:200]}") from None
    pixels = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255
    return pixels.reshape(shape)


def _per_sample(value: Any, count: int) -> list | None:
    """`value` as a JSON-ready list of `count` per-sample entries, or None when it is not per-sample."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist() if value.ndim >= 1 else None
    if not isinstance(value, (list, tuple)) or len(value) != count:
        return None
    try:
        return json.loads(json.dumps(list(value), default=_json_default))
    except (TypeError, ValueError):
        return None


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def encode_output(out: RewardOutput, count: int) -> dict[str, Any]:
    """The answer to a score request from a reward's `out` for `count` samples: ``scores`` (non-finite → null),
    ``maps`` as a float32 array (or null), and the per-sample ``info`` entries (tensors or lists of `count` entries;
    other entries are left out). Used by the reference server."""
    scores = [float(s) if np.isfinite(s) else None for s in out.scores.detach().float().cpu().tolist()]
    info = {}
    for key, value in (out.info or {}).items():
        listed = _per_sample(value, count)
        if listed is not None:
            info[str(key)] = listed
    maps = None if out.maps is None else encode_array(out.maps.detach().float(), "float32")
    return {"scores": scores, "maps": maps, "info": info}


def _info_value(values: list) -> torch.Tensor | list:
    """Per-sample info values as a tensor when they are all booleans (bool) or numbers (float32 / int64)."""
    if values and all(isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.bool)
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return torch.tensor(values, dtype=torch.int64 if all(isinstance(v, int) for v in values) else torch.float32)
    return values


def decode_output(answer: Any, count: int) -> RewardOutput:
    """The `RewardOutput` of a score answer for `count` samples (null or NaN scores become NaN, which the training
    loop's reward guard refuses, naming the reward).

    Raises:
        ValueError: when the answer is not an object, ``scores`` is not `count` numbers, ``maps`` does not start with
            `count`, or an ``info`` entry is not a list of `count` values.
    """
    if not isinstance(answer, dict):  # (a protocol error like the checks below, so ValueError)
        raise ValueError(f"the answer must be a JSON object with 'scores'; got {type(answer).__name__}")  # noqa: TRY004
    scores = answer.get("scores")
    if not isinstance(scores, list) or len(scores) != count or not all(
            s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)) for s in scores):
        raise ValueError(f"'scores' must be a list of {count} numbers (null for a sample it could not score); got "
                         f"{str(scores)[:200]}")
    maps = answer.get("maps")
    if maps is not None:
        maps = decode_array(maps, "maps").float()
        if maps.ndim not in (3, 4) or maps.shape[0] != count:
            raise ValueError(f"'maps' must have shape [{count}, H, W] or [{count}, F, H, W]; got {list(maps.shape)}")
    info = {}
    for key, values in (answer.get("info") or {}).items():
        if not isinstance(values, list) or len(values) != count:
            raise ValueError(f"info[{key!r}] must be a list of {count} per-sample values")
        info[key] = _info_value(values)
    return RewardOutput(scores=torch.tensor([float("nan") if s is None else float(s) for s in scores],
                                            dtype=torch.float32), info=info, maps=maps)


# ------------------------------------------------------------------------------------------------- the client


@config_schema("reward", "http")
@dataclass
class HttpRewardConfig:
    """Config of `HttpReward` (fields mirror its ``__init__``; docs/guides/rewards.md#rewards-served-over-http)."""

    _target_: str = "diffalign.rewards.http.HttpReward"
    url: str = ""
    image_format: str = "png"
    max_batch_size: int = 16
    max_concurrency: int = 2
    timeout: float = 120.0
    connect_timeout: float = 5.0
    max_retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 30.0
    check_health: bool = True


class HttpReward:
    """A reward computed by a server (``diffalign-reward-server`` or your own) that speaks ``diffalign-reward/1``.

    Args:
        url (`str`): the server's base address, e.g. ``http://127.0.0.1:8000`` (requests go to ``<url>/score``, the
            health check to ``<url>/health``). Required.
        image_format (`str`, defaults to "png"): how images travel: "png" (8-bit, lossless for 8-bit images; the
            smallest), "uint8" (the same values, raw) or "float32" (the float pixels exactly, 4 bytes per value).
        max_batch_size (`int`, defaults to 16): images (videos) per request; a larger batch is split.
        max_concurrency (`int`, defaults to 2): requests in flight at once (across batches).
        timeout (`float`, defaults to 120): seconds to wait for an answer to one request.
        connect_timeout (`float`, defaults to 5): seconds to wait for a connection.
        max_retries (`int`, defaults to 3): retries of a request that timed out, could not connect or got HTTP
            408/429/5xx.
        backoff (`float`, defaults to 1): seconds before the first retry, doubled before each further one.
        max_backoff (`float`, defaults to 30): the longest wait between retries.
        check_health (`bool`, defaults to True): ask ``<url>/health`` when built (with the same retries), so a server
            that is down or speaks another protocol stops the run before any sampling.

    Call: ``reward(images, prompts, metadata=None)`` with images `(B, 3, H, W)` or videos `(B, F, 3, H, W)`, float in
    [0, 1], `B` prompts and optional `B` JSON-serialisable metadata rows; returns the server's `RewardOutput`: scores
    `(B,)` float32 (NaN where the server sent null), optional ``maps`` `(B, H, W)` / `(B, F, H, W)` float32, and
    ``info`` with the server's per-sample entries (booleans → bool tensor, numbers → float32/int64 tensor, anything
    else a list). ``submit`` is the same, returning a `concurrent.futures.Future`.

    Raises:
        ValueError: for a bad setting (naming the ``reward.http.<field>``), or a batch that cannot be sent (shape,
            values outside [0, 1], prompts or metadata of another length).
        HttpRewardError: when the server is down, times out on every attempt, refuses the batch (HTTP 4xx, with the
            server's message) or answers something else than the protocol; the message names the server's URL.
    """

    modality = "any"  # images and videos alike; what the server accepts is the server's business
    differentiable = False
    name = "http"

    def __init__(self, url: str = "", image_format: str = "png", max_batch_size: int = 16, max_concurrency: int = 2,
                 timeout: float = 120.0, connect_timeout: float = 5.0, max_retries: int = 3, backoff: float = 1.0,
                 max_backoff: float = 30.0, check_health: bool = True):
        parts = urlsplit(url or "")
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"reward.http.url is required: the reward server's address, e.g. "
                             f"reward.http.url=http://127.0.0.1:8000 (got {url!r}); start a server with "
                             "`diffalign-reward-server <reward> --port 8000` "
                             "(docs/guides/rewards.md#rewards-served-over-http)")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"reward.http.image_format={image_format!r} must be one of {IMAGE_FORMATS}")
        for field, value in (("max_batch_size", max_batch_size), ("max_concurrency", max_concurrency)):
            if int(value) < 1:
                raise ValueError(f"reward.http.{field}={value} must be >= 1")
        for field, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not value > 0:
                raise ValueError(f"reward.http.{field}={value} must be > 0 seconds")
        if int(max_retries) < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError(f"reward.http.max_retries={max_retries}, backoff={backoff} and max_backoff={max_backoff} "
                             "must be >= 0")
        self.url = url.rstrip("/")
        self.image_format = image_format
        self.max_batch_size, self.max_concurrency = int(max_batch_size), int(max_concurrency)
        self.timeout, self.connect_timeout = float(timeout), float(connect_timeout)
        self.max_retries, self.backoff, self.max_backoff = int(max_retries), float(backoff), float(max_backoff)
        self._local = threading.local()  # one requests.Session per thread (a Session is not thread-safe)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.server_info: dict[str, Any] = {}
        if check_health:
            self.server_info = self.health()

    @classmethod
    def check_config(cls, node, prefix: str) -> None:
        """Checks of the reward's node before any model loads (`diffalign.config.validation`): ``url`` is an http(s)
        address and, unless ``check_health`` is false, the server answers ``GET <url>/health``: one request, connect
        timeout `HEALTH_CONNECT_TIMEOUT` (3 s), answer within `HEALTH_READ_TIMEOUT` (30 s), no retries. HTTP 200 is
        accepted (the protocol is checked when the reward is built); HTTP 404 (a server without a health route, e.g.
        one of your own that serves only ``/score``) is accepted with a warning, since the first ``/score`` request
        tells; any other answer, no connection or no answer is refused.

        Raises:
            ConfigError: naming ``<prefix>.url``, the address asked and the fix.
        """
        from diffalign.config.checks import ConfigError, choice, integer, number

        integer(node, "max_batch_size", prefix, ge=1)
        integer(node, "max_concurrency", prefix, ge=1)
        integer(node, "max_retries", prefix, ge=0, hint="0: no retries")
        for key in ("timeout", "connect_timeout"):
            number(node, key, prefix, gt=0, hint="seconds")
        for key in ("backoff", "max_backoff"):
            number(node, key, prefix, ge=0, hint="seconds between retries (doubled each time, up to max_backoff)")
        choice(node, "image_format", prefix, IMAGE_FORMATS)
        url = str(node.get("url") or "")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{prefix}.url is required: the reward server's address, e.g. {prefix}.url="
                              f"http://127.0.0.1:8000 (got {url!r}); start a server with `diffalign-reward-server "
                              "<reward> --port 8000` (docs/guides/rewards.md#rewards-served-over-http)")
        try:
            parts.port  # noqa: B018 - urllib checks the port when it is read
        except ValueError as err:
            raise ConfigError(f"{prefix}.url={url}: {err} (a port is 0-65535); correct {prefix}.url, e.g. "
                              f"{prefix}.url=http://127.0.0.1:8000") from None
        if not node.get("check_health", True):
            return
        health = f"{url.rstrip('/')}/health"
        fix = (f"start it (`diffalign-reward-server <reward> --port {parts.port or '<port>'}`), correct {prefix}.url, "
               f"or set {prefix}.check_health=false to skip this check (the run then fails at its first reward call)")
        try:
            response = requests.get(health, timeout=(HEALTH_CONNECT_TIMEOUT, HEALTH_READ_TIMEOUT))
        except requests.Timeout as err:
            raise ConfigError(f"{prefix}.url={url}: the reward server did not answer GET {health} (connect timeout "
                              f"{HEALTH_CONNECT_TIMEOUT:g} s, answer {HEALTH_READ_TIMEOUT:g} s: {type(err).__name__}); "
                              f"{fix}") from None
        except requests.RequestException as err:
            raise ConfigError(f"{prefix}.url={url}: the reward server cannot be reached (GET {health}: "
                              f"{type(err).__name__}); {fix}") from None
        if response.status_code == 404:
            logger.warning(NO_HEALTH_ROUTE.format(url=url.rstrip("/")))
            return
        if response.status_code != 200:
            raise ConfigError(f"{prefix}.url={url}: GET {health} answered HTTP {response.status_code}: "
                              f"{_error_text(response)}; the server is up but not healthy: {fix}")

    def __repr__(self) -> str:
        served = self.server_info.get("reward")
        return f"HttpReward({self.url!r}{f', serving {served!r}' if served else ''})"

    # ------------------------------------------------------------------------------------------- requests

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _send(self, method: str, path: str, what: str, body: bytes | None = None) -> Any:
        """The decoded JSON answer of one request, with retries (see the module docstring).

        Raises:
            HttpRewardError: naming the URL, `what` was asked and the last failure.
        """
        url, last = f"{self.url}{path}", ""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                detail = f"{what} failed ({last}); retry {attempt} of {self.max_retries} in {delay:.1f} s"
                warn_repeated(logger, "reward_retries", f"reward server {literal(self.url)}: {{count}} request(s) "
                              f"retried, the last: {literal(detail)}", count=1)
                time.sleep(delay)
            try:
                response = self._session().request(method, url, data=body, headers=headers,
                                                   timeout=(self.connect_timeout, self.timeout))
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
                kind = "timed out" if isinstance(err, requests.Timeout) else "connection failed"
                last = f"{kind}: {type(err).__name__}: {err}"
                continue
            if response.status_code == 200:
                try:
                    return response.json()
                except ValueError as err:
                    raise HttpRewardError(f"reward server {self.url}: the answer to {what} is not JSON ({err}): "
                                          f"{response.text[:200]!r}") from None
            message = _error_text(response)
            if response.status_code not in RETRY_STATUS:
                raise HttpRewardError(f"reward server {self.url} refused {what}: HTTP {response.status_code}: "
                                      f"{message}", status=response.status_code)
            last = f"HTTP {response.status_code}: {message}"
        raise HttpRewardError(
            f"reward server {self.url} did not answer {what} after {self.max_retries + 1} attempt(s) "
            f"(timeout {self.timeout:g} s each; last: {last}). Is it running? Check {self.url}/health; start one with "
            "`diffalign-reward-server <reward> --port <port>`, or raise reward.http.timeout / max_retries")

    def health(self) -> dict[str, Any]:
        """The server's ``/health`` answer (``status``, ``protocol``, ``reward``...).

        Raises:
            HttpRewardError: the server is not reachable (after the retries), not healthy, or speaks another protocol.
        """
        try:
            answer = self._send("GET", "/health", "the health check")
        except HttpRewardError as err:
            if err.status != 404:
                raise
            logger.warning(NO_HEALTH_ROUTE.format(url=self.url))
            return {}
        if not isinstance(answer, dict) or answer.get("status") != "ok":
            raise HttpRewardError(f"reward server {self.url} is not healthy: {str(answer)[:200]}")
        if answer.get("protocol") != PROTOCOL:
            raise HttpRewardError(f"reward server {self.url} speaks {answer.get('protocol')!r}, not {PROTOCOL!r}; "
                                  "update the server or diffalign so that both speak the same protocol")
        return answer

    def _score(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        """One request: encodes `pixels` (a CPU copy), posts it and decodes the answer."""
        what = f"a batch of {len(prompts)}"
        body = json.dumps({"protocol": PROTOCOL, "prompts": prompts, "metadata": metadata,
                           "images": encode_images(pixels, self.image_format)}, default=_json_default).encode()
        answer = self._send("POST", "/score", what, body)
        try:
            return decode_output(answer, len(prompts))
        except ValueError as err:
            raise HttpRewardError(f"reward server {self.url}: bad answer to {what}: {err}") from None

    # ------------------------------------------------------------------------------------------- the reward

    def submit(self, images: torch.Tensor, prompts: list[str],
               metadata: list[dict[str, Any]] | None = None) -> Future:
        """Starts scoring a batch in the background (see the class docstring for the arguments); the images are
        copied to the CPU before it returns. Batches above ``max_batch_size`` go as several requests.

        Returns:
            `concurrent.futures.Future` of the batch's `RewardOutput`; its exception is the first failing request's
            `HttpRewardError`.

        Raises:
            ValueError: a batch that cannot be sent (checked here, before anything is sent).
        """
        if not isinstance(images, torch.Tensor) or images.ndim not in (4, 5) or images.shape[-3] != 3:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"reward 'http' expects images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]; got "
                             f"{shape}")
        count = images.shape[0]
        if len(prompts) != count or (metadata is not None and len(metadata) != count):
            raise ValueError(f"reward 'http' got {count} images, {len(prompts)} prompts and "
                             f"{None if metadata is None else len(metadata)} metadata rows; pass one per image")
        pixels = images.detach().to("cpu", torch.float32, copy=True)
        if not torch.isfinite(pixels).all() or (pixels.numel() and (pixels.min() < 0 or pixels.max() > 1)):
            raise ValueError("reward 'http' expects finite images in [0, 1] (decoded and clamped)")
        pool = self._executor()
        parts = [pool.submit(self._score, pixels[start:start + self.max_batch_size],
                             list(prompts[start:start + self.max_batch_size]),
                             None if metadata is None else list(metadata[start:start + self.max_batch_size]))
                 for start in range(0, count, self.max_batch_size)]
        return gather(parts, concat_outputs)

    def __call__(self, images: torch.Tensor, prompts: list[str],
                 metadata: list[dict[str, Any]] | None = None) -> RewardOutput:
        """Scores a batch and waits for the answer (see the class docstring)."""
        return self.submit(images, prompts, metadata).result()

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="diffalign-http-reward")
            return self._pool

    def close(self) -> None:
        """Cancels the requests not yet started and stops the worker threads (a later call starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _error_text(response: requests.Response) -> str:
    """The ``error`` field of a JSON error answer, else the start of its text."""
    try:
        answer = response.json()
    except ValueError:
        return response.text[:300] or response.reason or ""
    return str(answer.get("error", answer) if isinstance(answer, dict) else answer)[:300]
