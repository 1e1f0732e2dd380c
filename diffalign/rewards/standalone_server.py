"""A reward server for diffalign's ``reward=[http]`` in one file that does not import diffalign or torch: copy it into
the environment of your reward model (mmdet for GenEval, an OCR engine, a vLLM judge...), replace `score`, and run

    python standalone_server.py --port 8000
    diffalign-train ... reward=[http] reward.http.url=http://HOST:8000     # in the training environment

(``diffalign-reward-server --template > standalone_server.py`` writes this file.) It needs Python >= 3.8, numpy and
pillow, and speaks the protocol ``diffalign-reward/1`` of docs/guides/rewards.md#rewards-served-over-http: ``GET
/health`` and ``POST /score`` with JSON bodies; images arrive as base64 PNGs (``reward.http.image_format=png``, the
default) or raw uint8 / float32 arrays. The example `score` is the mean luma of each image, so it runs as it is.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import threading
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

_DTYPES = {"uint8": np.dtype("u1"), "float32": np.dtype("<f4")}


def decode_images(obj: dict) -> np.ndarray:
    """An image batch object → `(B, H, W, 3)` (or `(B, F, H, W, 3)`) uint8 (png, uint8) or float32 (float32)."""
    shape = [int(n) for n in obj["shape"]]  # [B, 3, H, W] or [B, F, 3, H, W]
    if obj["format"] == "png":
        frames = [np.asarray(Image.open(io.BytesIO(base64.b64decode(item))).convert("RGB")) for item in obj["data"]]
        return np.stack(frames).reshape(shape[:-3] + [shape[-2], shape[-1], 3])
    raw = np.frombuffer(base64.b64decode(obj["data"]), dtype=_DTYPES[obj["format"]]).reshape(shape)
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
    lock = threading.Lock()  # one batch at a time: most models are not thread-safe

    def answer(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/health":
            self.answer(200, {"status": "ok", "protocol": PROTOCOL, "reward": NAME})
        else:
            self.answer(404, {"error": "GET /health or POST /score"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/score":
            self.answer(404, {"error": "GET /health or POST /score"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if request.get("protocol") != PROTOCOL:
                raise ValueError(f"protocol {request.get('protocol')!r} is not {PROTOCOL!r}")
            images = decode_images(request["images"])
        except Exception as err:  # noqa: BLE001 - a malformed request: 400, not retried by the client
            self.answer(400, {"error": f"bad request: {type(err).__name__}: {err}"})
            return
        try:
            with self.lock:
                result = score(images, request["prompts"], request.get("metadata"))
            answer = encode_answer(result, len(images))
        except Exception as err:  # noqa: BLE001 - the reward failed: 422, not retried; the run stops naming it
            self.answer(422, {"error": f"{type(err).__name__}: {err}"})
            return
        self.answer(200, answer)


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"a {PROTOCOL} reward server ({NAME})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"serving {NAME} at http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
