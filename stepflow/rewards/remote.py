"""Rewards served over HTTP: the JSON protocol of ``python -m stepflow.serve_reward`` and its client.

Some rewards need their own environment (GenEval's mmdet, PaddleOCR, a VLM): run them in a separate process or
machine with ``python -m stepflow.serve_reward reward=<name> port=<port>`` and score through
``reward=remote reward.url=http://host:port`` (or ``reward=geneval_server``). Only the standard library is used.

Protocol (JSON, UTF-8; never pickle)::

    POST <url>   {"images": ["<base64 PNG>", ...], "prompts": ["...", ...], "meta": [{...}, ...] | null}
    200          {"scores": [float, ...], "components": {"<name>": [float, ...], ...}}
    4xx / 5xx    {"error": "<one line>"}
    GET  /health {"status": "ok", "reward": "<name>"}

Failure policy (shared with :mod:`stepflow.rewards.unifiedreward`): timeouts, connection errors, 429 and 5xx are
retried ``max_retries`` times with exponential backoff ``backoff_s · 2^attempt`` (capped at ``max_backoff_s``);
then, or at once on any other 4xx, :class:`RewardServiceError` is raised (one line: URL, attempts, last error), so
the training loop can checkpoint and stop cleanly. A reply that is not what the protocol promises raises
:class:`MalformedReplyError` naming what was expected.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.errors import MalformedReplyError, RewardServiceError, one_line
from stepflow.rewards.loading import to_uint8

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


# ---------------------------------------------------------------- images <-> base64 PNG


class ImageLimitError(ValueError):
    """An image (or a request's images together) has more pixels than allowed; raised from the header, undecoded."""


def png_b64(img: np.ndarray | Image.Image) -> str:
    """(H, W, 3) uint8 array or PIL image -> base64 (ASCII) of its lossless PNG encoding."""
    im = img if isinstance(img, Image.Image) else Image.fromarray(img)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_images(images: Tensor) -> list[str]:
    """(B, 3, H, W) in [0, 1] -> B base64 PNG strings (uint8-rounded, as every reward sees them)."""
    return [png_b64(a) for a in to_uint8(images)]


def decode_images(items: Sequence[str], max_image_pixels: int | None = None,
                  max_total_pixels: int | None = None) -> Tensor:
    """B base64 PNG (or JPEG) strings of one size -> (B, 3, H, W) float in [0, 1].

    Every header is read first (PIL opens lazily): sizes over ``max_image_pixels`` (one image) or
    ``max_total_pixels`` (all of them) raise :class:`ImageLimitError`, and images of different sizes a ValueError,
    before any pixel is decoded."""
    opened: list[Image.Image] = []
    try:
        total = 0
        for i, s in enumerate(items):
            if not isinstance(s, str):
                raise ValueError(f"images[{i}] must be a base64 string, got {type(s).__name__}")
            if s.startswith("data:"):
                s = s.split(",", 1)[-1]
            try:
                raw = base64.b64decode(s, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"images[{i}] is not valid base64") from None
            try:
                im = Image.open(io.BytesIO(raw), formats=("PNG", "JPEG"))
            except Image.DecompressionBombError as e:
                raise ImageLimitError(f"images[{i}]: {one_line(e, 160)}") from None
            except Exception as e:  # noqa: BLE001 - UnidentifiedImageError, struct errors from a broken header
                raise ValueError(f"images[{i}] is not a PNG or JPEG image ({type(e).__name__})") from None
            opened.append(im)
            w, h = im.size
            if max_image_pixels is not None and w * h > max_image_pixels:
                raise ImageLimitError(f"images[{i}] is {w}x{h} = {w * h} pixels; the limit is {max_image_pixels} "
                                      f"pixels per image (max_image_pixels)")
            total += w * h
            if max_total_pixels is not None and total > max_total_pixels:
                raise ImageLimitError(f"images[0..{i}] hold {total} pixels; the limit is {max_total_pixels} pixels "
                                      f"per request (max_request_pixels): send smaller batches")
            if im.size != opened[0].size:
                raise ValueError(f"all images of a request must have one size, got {opened[0].size[0]}x"
                                 f"{opened[0].size[1]} and {w}x{h} (images[{i}])")
        if not opened:
            return torch.zeros(0, 3, 1, 1)
        w, h = opened[0].size
        out = torch.empty(len(opened), 3, h, w)
        for i, im in enumerate(opened):
            try:
                arr = np.array(im.convert("RGB"))  # a writable (H, W, 3) uint8 copy
            except Exception as e:  # noqa: BLE001 - truncated / corrupt pixel data
                raise ValueError(f"images[{i}] cannot be decoded ({type(e).__name__}: {one_line(e, 120)})") from None
            out[i] = torch.from_numpy(arr).permute(2, 0, 1)
        return out.div_(255.0)
    finally:
        for im in opened:
            im.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    raise TypeError(f"meta value of type {type(x).__name__} is not JSON-serializable")


# ---------------------------------------------------------------- HTTP with retries


def post_json(url: str, payload: dict, *, timeout_s: float, max_retries: int, backoff_s: float,
              max_backoff_s: float = 60.0, headers: dict[str, str] | None = None, what: str = "reward service",
              sleep: Callable[[float], None] = time.sleep) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON reply, with the retry policy of the module docstring."""
    body = json.dumps(payload, default=_jsonable).encode()
    hdrs = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    last = "no attempt"
    attempts = max(0, int(max_retries)) + 1
    for attempt in range(attempts):
        if attempt:
            delay = min(backoff_s * 2 ** (attempt - 1), max_backoff_s)
            log.warning("%s: %s; retry %d/%d in %.2fs", what, last, attempt, attempts - 1, delay)
            sleep(delay)
        req = urllib.request.Request(url, data=body, headers=hdrs, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            last = f"HTTP {e.code}{': ' + detail if detail else ''}"
            if e.code in RETRY_STATUS:
                continue
            raise RewardServiceError(f"{what}: POST {url} was refused ({last})") from None
        except TimeoutError as e:
            last = f"timeout after {timeout_s:g}s ({one_line(e, 80) or 'no reply'})"
            continue
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                last = f"timeout after {timeout_s:g}s"
            else:
                last = f"connection failed ({one_line(reason, 120)})"
            continue
        except (http.client.HTTPException, ConnectionError, OSError) as e:
            last = f"{type(e).__name__}: {one_line(e, 120)}"
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise MalformedReplyError(f"{what}: POST {url} answered non-JSON ({one_line(raw[:120])!r}); "
                                      f"expected a JSON object") from None
    raise RewardServiceError(f"{what}: POST {url} failed after {attempts} attempt(s) (last error: {last}); "
                             f"is the service running and reachable?")


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        data = e.read()
        try:
            return one_line(json.loads(data).get("error", data.decode(errors="replace")), 200)
        except (ValueError, AttributeError):
            return one_line(data.decode(errors="replace"), 200)
    except Exception:  # noqa: BLE001
        return ""


def parse_reply(data: Any, n: int, what: str, url: str) -> RewardOut:
    """Check a ``{"scores": [n floats], "components": {name: [n floats]}}`` reply and turn it into a RewardOut."""
    expected = f'expected {{"scores": [{n} numbers], "components": {{name: [{n} numbers]}}}}'
    if not isinstance(data, dict) or "scores" not in data:
        got = sorted(data)[:5] if isinstance(data, dict) else type(data).__name__
        raise MalformedReplyError(f"{what}: reply from {url} has no 'scores' (got {got}); {expected}")

    def vec(x: Any, field: str) -> Tensor:
        if not isinstance(x, list) or len(x) != n or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                               for v in x):
            desc = f"a list of {len(x)}" if isinstance(x, list) else type(x).__name__
            raise MalformedReplyError(f"{what}: reply from {url}: '{field}' is {desc}; {expected}")
        return torch.tensor(x, dtype=torch.float32)

    comps = data.get("components") or {}
    if not isinstance(comps, dict):
        raise MalformedReplyError(f"{what}: reply from {url}: 'components' is {type(comps).__name__}; {expected}")
    return RewardOut(vec(data["scores"], "scores"), {str(k): vec(v, f"components.{k}") for k, v in comps.items()})


# ---------------------------------------------------------------- the client reward


class RemoteReward(Reward):
    """Scores by POSTing batches to a ``stepflow.serve_reward`` service (or any server speaking the protocol).

    url: the endpoint (``http://127.0.0.1:18085``); request_batch_size: images per request; concurrency: requests
    in flight at once; send_meta: include ``meta`` (must be JSON-serializable); headers: extra HTTP headers.
    Components are whatever the service returns.
    """

    name = "remote"
    batch_size = 1 << 30  # the whole batch reaches score(); it is split into requests there

    def __init__(self, url: str = "http://127.0.0.1:18085", request_batch_size: int = 64, concurrency: int = 1,
                 timeout_s: float = 120.0, max_retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 send_meta: bool = True, headers: dict[str, str] | None = None, name: str | None = None):
        self.url = url
        self.request_batch_size = int(request_batch_size)
        self.concurrency = max(1, int(concurrency))
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.send_meta = bool(send_meta)
        self.headers = dict(headers or {})
        if name:
            self.name = name
        self._sleep: Callable[[float], None] = time.sleep

    def _request(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        payload = {"images": encode_images(images), "prompts": list(prompts),
                   "meta": list(meta) if (meta is not None and self.send_meta) else None}
        data = post_json(self.url, payload, timeout_s=self.timeout_s, max_retries=self.max_retries,
                         backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s, headers=self.headers,
                         what=f"reward {self.name}", sleep=self._sleep)
        return parse_reply(data, len(prompts), f"reward {self.name}", self.url)

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        step = self.request_batch_size
        chunks = [(images[i:i + step], prompts[i:i + step], None if meta is None else meta[i:i + step])
                  for i in range(0, len(prompts), step)]
        if self.concurrency == 1 or len(chunks) == 1:
            outs = [self._request(*c) for c in chunks]
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(chunks))) as pool:
                outs = list(pool.map(lambda c: self._request(*c), chunks))
        keys = set(outs[0].components)
        if any(set(o.components) != keys for o in outs):
            raise MalformedReplyError(f"reward {self.name}: replies from {self.url} disagree on component names")
        return RewardOut(torch.cat([o.scores for o in outs]),
                         {k: torch.cat([o.components[k] for o in outs]) for k in sorted(keys)})
