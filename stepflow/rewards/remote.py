"""Rewards served over HTTP: the JSON protocol of ``python -m stepflow.serve_reward`` and its client, and a client
for the GenEval reward server that Flow-GRPO's users run (``protocol="flow_grpo"``).

Some rewards need their own environment (GenEval's mmdet, PaddleOCR, a VLM): run them in a separate process or
machine with ``python -m stepflow.serve_reward reward=<name> port=<port>`` and score through
``reward=remote reward.url=http://host:port`` (or ``reward=geneval_server``). Only the standard library is used.

stepflow's protocol (``protocol="stepflow"``, the default; JSON, UTF-8; never pickle)::

    POST <url>   {"images": ["<base64 PNG>", ...], "prompts": ["...", ...], "meta": [{...}, ...] | null}
                 (videos: each item of "images" a list of F base64 PNG frames, every video of one length; the
                 served reward must score videos, e.g. ``serve_reward reward=frames``; ``reward.video=true`` here)
    200          {"scores": [float, ...], "components": {"<name>": [float, ...], ...}}
    4xx / 5xx    {"error": "<one line>"}
    GET  /health {"status": "ok", "reward": "<name>"}

A score may be ``NaN`` / ``Infinity`` (Python's JSON extension) or ``null`` (read as NaN): such scores are kept,
counted and named in one warning per call; the training loop drops non-finite samples.

Flow-GRPO's GenEval server (``protocol="flow_grpo"``; github ``yifan123/reward-server`` ``app_geneval.py``, client
``flow_grpo/rewards.py`` ``geneval_score``)::

    POST <url>   pickle({"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata dict, ...],
                         "only_strict": bool})                       (Content-Type: application/octet-stream)
    200          pickle({"scores": [partial credit], "rewards": [0/1 GenEval rule], "strict_rewards": [0/1 exact],
                         "group_rewards": {tag: [...]}, "group_strict_rewards": {tag: [...]}})
    500          the server's traceback as text

Its replies are unpickled (with an unpickler that refuses every class but plain data and numpy scalars / arrays),
so that server must be trusted: a warning says so once.

Failure policy (shared with :mod:`stepflow.rewards.unifiedreward`): timeouts, connection errors, 408, 429 and 5xx are
retried ``max_retries`` times with exponential backoff ``backoff_s · 2^attempt`` (capped at ``max_backoff_s``);
then, or at once on any other 4xx (``serve_reward`` answers 400 / 413 for a malformed or oversized request and 422
for metadata its reward cannot use), :class:`RewardServiceError` is raised (one line: URL, attempts, last error,
the server's own one-line reason), so the training loop can checkpoint and stop cleanly. A reply that is not what
the protocol promises raises :class:`MalformedReplyError` naming what was expected.

Settings are checked when the reward is built, before any request (:class:`RemoteConfigError`, one line naming
``reward.<field>``): ``url`` an http(s) URL with a host (:func:`check_url`), ``timeout_s`` and ``max_reply_mb`` > 0,
``max_retries``, ``backoff_s``, ``max_backoff_s``, ``progress_every_s`` >= 0, ``request_batch_size`` and
``concurrency`` integers >= 1, ``jpeg_quality`` in 1..100 (every number finite), ``headers`` one-line strings.
Per call, ``meta`` must hold one record (a dict or None) per prompt (:func:`check_meta`), before anything is sent.

Waiting is interruptible: the HTTP exchange runs in a daemon thread while the caller waits in slices of
``POLL_S`` seconds, so :mod:`stepflow.core.stop` (set by the training run's SIGTERM handler) raises
:class:`~stepflow.errors.StopRequested` within about ``POLL_S``, during a request or a back-off. ``timeout_s`` bounds
each attempt in total (not per socket read), and a request still waiting logs a warning every
``progress_every_s`` seconds.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures as cf
import http.client
import io
import json
import logging
import math
import numbers
import pickle
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from stepflow.core import stop
from stepflow.errors import MalformedReplyError, RemoteConfigError, RewardServiceError, one_line
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import to_uint8

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: the longest a wait goes without looking at :data:`stepflow.core.stop.STOP` (seconds)
POLL_S = 0.25
PROTOCOLS = ("stepflow", "flow_grpo")
#: ``geneval_score`` -> the field of the GenEval server's reply that becomes ``scores``
GENEVAL_SCORES = {"partial": "scores", "strict": "strict_rewards", "correct": "rewards"}


# ---------------------------------------------------------------- images <-> base64 PNG


class ImageLimitError(ValueError):
    """An image (or a request's images together) has more pixels than allowed; raised from the header, undecoded."""


def png_b64(img: np.ndarray | Image.Image) -> str:
    """(H, W, 3) uint8 array or PIL image -> base64 (ASCII) of its lossless PNG encoding."""
    im = img if isinstance(img, Image.Image) else Image.fromarray(img)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_images(images: Tensor) -> list[str] | list[list[str]]:
    """(B, 3, H, W) in [0, 1] -> B base64 PNG strings (uint8-rounded, as every reward sees them); videos
    (B, 3, F, H, W) -> B lists of F base64 PNG frames (the protocol's video item)."""
    if images.ndim == 5:
        b, f = images.shape[0], images.shape[2]
        flat = [png_b64(a) for a in to_uint8(images.transpose(1, 2).flatten(0, 1))]
        return [flat[i * f:(i + 1) * f] for i in range(b)]
    return [png_b64(a) for a in to_uint8(images)]


def decode_videos(items: Sequence[Sequence[str]], max_image_pixels: int | None = None,
                  max_total_pixels: int | None = None) -> Tensor:
    """B lists of F base64 PNG (or JPEG) frames, every video of one frame count and size -> (B, 3, F, H, W) in
    [0, 1] (:func:`decode_images` on all the frames: the pixel limits count every frame)."""
    counts = {len(v) if isinstance(v, list) else -1 for v in items}
    if len(counts) != 1 or -1 in counts or 0 in counts:
        raise ValueError("a video request's items must all be non-empty lists of frames of one length")
    f = counts.pop()
    flat = decode_images([x for v in items for x in v], max_image_pixels, max_total_pixels)
    return flat.view(len(items), f, *flat.shape[1:]).transpose(1, 2).contiguous()


def encode_jpeg(images: Tensor, quality: int = 75) -> list[bytes]:
    """(B, 3, H, W) in [0, 1] -> B JPEG files (bytes), as Flow-GRPO's ``geneval_score`` sends them (PIL's default
    quality is 75)."""
    out = []
    for a in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="JPEG", quality=int(quality))
        out.append(buf.getvalue())
    return out


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


# ---------------------------------------------------------------- interruptible HTTP with retries


class _ReplyTooLarge(OSError):
    pass


class _Cancelled(Exception):
    """A call of :func:`map_interruptible` whose result is no longer wanted (another one failed)."""


_local = threading.local()  # .cancel: the threading.Event of the map_interruptible call this thread works for


def _check() -> None:
    """Raise StopRequested on a stop request, _Cancelled when this thread's map_interruptible call was abandoned."""
    stop.check()
    cancel = getattr(_local, "cancel", None)
    if cancel is not None and cancel.is_set():
        raise _Cancelled


def backoff_wait(seconds: float) -> None:
    """The retry back-off: sleeps ``seconds`` in :data:`POLL_S` slices, raising StopRequested on a stop request."""
    end = time.monotonic() + max(0.0, float(seconds))
    while True:
        _check()
        left = end - time.monotonic()
        if left <= 0:
            return
        stop.wait(min(POLL_S, left))


def _exchange(req: urllib.request.Request, *, timeout_s: float, max_reply_bytes: int, what: str, url: str,
              desc: str, progress_every_s: float) -> bytes:
    """One HTTP exchange, run in a daemon thread while this one waits in :data:`POLL_S` slices: raises
    StopRequested as soon as a stop is requested, TimeoutError after ``timeout_s`` in total, and logs a warning
    every ``progress_every_s`` seconds of waiting. Returns the reply body; HTTP errors are raised as urllib's."""
    _check()
    box: dict[str, Any] = {}
    done = threading.Event()

    def work() -> None:
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read(max_reply_bytes + 1)
            if len(raw) > max_reply_bytes:
                raise _ReplyTooLarge(f"reply over {max_reply_bytes} bytes (max_reply_mb)")
            box["raw"] = raw
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["exc"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="stepflow-reward-http", daemon=True).start()
    t0 = time.monotonic()
    next_log = progress_every_s if progress_every_s and progress_every_s > 0 else math.inf
    while not done.wait(POLL_S):
        _check()  # the worker is abandoned: its socket times out on its own, the process is stopping anyway
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            raise TimeoutError(f"no complete reply within {timeout_s:g}s")
        if waited >= next_log:
            log.warning("%s: waiting %.0f s for %s (%s)", what, waited, url, desc)
            next_log += progress_every_s
    if "exc" in box:
        raise box["exc"]
    return box["raw"]


def post(url: str, body: bytes, *, content_type: str, timeout_s: float, max_retries: int, backoff_s: float,
         max_backoff_s: float = 60.0, headers: dict[str, str] | None = None, what: str = "reward service",
         sleep: Callable[[float], None] = backoff_wait, progress_every_s: float = 10.0, desc: str = "",
         max_reply_mb: float = 64.0) -> bytes:
    """POST ``body`` and return the reply body, with the retry policy and interruptible waits of the module
    docstring. ``sleep`` is the back-off wait (default :func:`backoff_wait`, interruptible)."""
    hdrs = {"Content-Type": content_type, **(headers or {})}
    last = "no attempt"
    attempts = max(0, int(max_retries)) + 1
    max_reply_bytes = int(float(max_reply_mb) * 2**20)
    for attempt in range(attempts):
        if attempt:
            delay = min(backoff_s * 2 ** (attempt - 1), max_backoff_s)
            log.warning("%s: %s; retry %d/%d in %.2fs", what, last, attempt, attempts - 1, delay)
            sleep(delay)
        req = urllib.request.Request(url, data=body, headers=hdrs, method="POST")
        info = ", ".join(x for x in (desc, f"attempt {attempt + 1}/{attempts}", f"timeout {timeout_s:g} s") if x)
        try:
            return _exchange(req, timeout_s=timeout_s, max_reply_bytes=max_reply_bytes, what=what, url=url,
                             desc=info, progress_every_s=progress_every_s)
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            last = f"HTTP {e.code}{': ' + detail if detail else ''}"
            if e.code in RETRY_STATUS:
                continue
            raise RewardServiceError(f"{what}: POST {url} was refused ({last})") from None
        except TimeoutError as e:
            last = f"timeout after {timeout_s:g}s ({one_line(e, 80) or 'no reply'})"
            continue
        except _ReplyTooLarge as e:
            raise MalformedReplyError(f"{what}: POST {url} answered a {one_line(e)}") from None
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
    raise RewardServiceError(f"{what}: POST {url} failed after {attempts} attempt(s) (last error: {last}); "
                             f"is the service running and reachable?")


def post_json(url: str, payload: dict, *, timeout_s: float, max_retries: int, backoff_s: float,
              max_backoff_s: float = 60.0, headers: dict[str, str] | None = None, what: str = "reward service",
              sleep: Callable[[float], None] = backoff_wait, progress_every_s: float = 10.0, desc: str = "",
              max_reply_mb: float = 64.0) -> Any:
    """POST ``payload`` as JSON and return the decoded JSON reply (:func:`post`'s policy)."""
    body = json.dumps(payload, default=_jsonable).encode()
    raw = post(url, body, content_type="application/json", headers={"Accept": "application/json", **(headers or {})},
               timeout_s=timeout_s, max_retries=max_retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s,
               what=what, sleep=sleep, progress_every_s=progress_every_s, desc=desc, max_reply_mb=max_reply_mb)
    try:
        return json.loads(raw)
    except ValueError:
        raise MalformedReplyError(f"{what}: POST {url} answered non-JSON ({one_line(raw[:120])!r}); "
                                  f"expected a JSON object") from None


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        data = e.read(64 * 1024)
        try:
            return one_line(json.loads(data).get("error", data.decode(errors="replace")), 200)
        except (ValueError, AttributeError):
            text = data.decode(errors="replace").strip()
            if text.startswith("Traceback"):  # a Python server's traceback (Flow-GRPO's reward-server): its last line
                text = f"{text.splitlines()[-1]} (server traceback)"
            return one_line(text, 200)
    except Exception:  # noqa: BLE001
        return ""


def map_interruptible(fn: Callable[..., Any], calls: Sequence[tuple], *, concurrency: int, what: str = "reward",
                      url: str = "", unit: str = "requests", progress_every_s: float = 0.0) -> list[Any]:
    """``[fn(*c) for c in calls]`` on ``concurrency`` threads while this thread waits in :data:`POLL_S` slices:
    the first exception (or a stop request: StopRequested) cancels what has not started and is raised at once;
    a warning every ``progress_every_s`` seconds says how many calls are done."""
    if not calls:
        return []
    stop.check()
    cancel = threading.Event()

    def run(*c: Any) -> Any:
        _local.cancel = cancel
        try:
            _check()
            return fn(*c)
        finally:
            _local.cancel = None

    pool = cf.ThreadPoolExecutor(max_workers=max(1, min(int(concurrency), len(calls))),
                                 thread_name_prefix="stepflow-reward")
    try:
        futs = [pool.submit(run, *c) for c in calls]
        t0 = time.monotonic()
        next_log = progress_every_s if progress_every_s and progress_every_s > 0 else math.inf
        while True:
            done, pending = cf.wait(futs, timeout=POLL_S, return_when=cf.FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None and not isinstance(f.exception(), _Cancelled):
                    raise f.exception()
            if not pending:
                return [f.result() for f in futs]
            stop.check()
            waited = time.monotonic() - t0
            if waited >= next_log:
                log.warning("%s: %d/%d %s done after %.0f s, waiting for %s", what, len(done), len(futs), unit,
                            waited, url)
                next_log += progress_every_s
    finally:
        cancel.set()  # calls still running give up within POLL_S (their threads must not outlive the call)
        pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- replies


def _vec(x: Any, n: int, field: str, what: str, url: str, expected: str) -> Tensor:
    """A list of ``n`` real numbers (``null`` -> NaN) -> (n,) float32; anything else is a MalformedReplyError."""
    if not isinstance(x, (list, tuple)) or len(x) != n or not all(
            v is None or (isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))) for v in x):
        desc = f"a list of {len(x)}" if isinstance(x, (list, tuple)) else type(x).__name__
        raise MalformedReplyError(f"{what}: reply from {url}: '{field}' is {desc}; {expected}")
    return torch.tensor([math.nan if v is None else float(v) for v in x], dtype=torch.float32)


def parse_reply(data: Any, n: int, what: str, url: str) -> RewardOut:
    """Check a ``{"scores": [n floats], "components": {name: [n floats]}}`` reply and turn it into a RewardOut.
    Non-finite numbers (NaN, inf; ``null`` is read as NaN) are kept: :func:`warn_non_finite` counts them."""
    expected = f'expected {{"scores": [{n} numbers], "components": {{name: [{n} numbers]}}}}'
    if not isinstance(data, dict) or "scores" not in data:
        got = sorted(data)[:5] if isinstance(data, dict) else type(data).__name__
        raise MalformedReplyError(f"{what}: reply from {url} has no 'scores' (got {got}); {expected}")
    comps = data.get("components") or {}
    if not isinstance(comps, dict):
        raise MalformedReplyError(f"{what}: reply from {url}: 'components' is {type(comps).__name__}; {expected}")
    return RewardOut(_vec(data["scores"], n, "scores", what, url, expected),
                     {str(k): _vec(v, n, f"components.{k}", what, url, expected) for k, v in comps.items()})


def warn_non_finite(out: RewardOut, what: str, url: str) -> int:
    """Log one warning naming how many scores (and component values) of ``out`` are NaN / inf; returns the count
    of non-finite scores."""
    bad = int((~torch.isfinite(out.scores)).sum())
    bad_c = {k: int((~torch.isfinite(v)).sum()) for k, v in out.components.items()}
    bad_c = {k: v for k, v in bad_c.items() if v}
    if bad or bad_c:
        comp = f"; non-finite component values: {', '.join(f'{k} {v}' for k, v in bad_c.items())}" if bad_c else ""
        log.warning("%s: %d of %d scores from %s are not finite (NaN / inf); the training loop drops those "
                    "samples%s", what, bad, out.scores.numel(), url, comp)
    return bad


class _DataUnpickler(pickle.Unpickler):
    """Unpickles plain data only: every global is refused except containers and numpy scalars / arrays."""

    ALLOWED = frozenset({
        ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
        ("builtins", "list"), ("builtins", "dict"), ("builtins", "float"), ("builtins", "int"),
        ("collections", "OrderedDict"), ("collections", "defaultdict"),
        ("numpy", "dtype"), ("numpy", "ndarray"),
        ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    })

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} (only plain data is accepted)")


def data_unpickle(raw: bytes) -> Any:
    """``pickle.loads`` restricted to plain data (:class:`_DataUnpickler`); raises ``pickle.UnpicklingError``."""
    return _DataUnpickler(io.BytesIO(raw)).load()


def geneval_meta(meta: Sequence[dict] | None, prompts: Sequence[str], what: str) -> list[dict]:
    """stepflow's per-prompt meta -> the ``meta_datas`` Flow-GRPO's GenEval server reads (``tag``, ``include``
    [``class``, ``count``, optional ``color``, ``position``], optional ``exclude``, ``prompt``), as plain
    builtins (JSON round trip: tensors / numpy become lists and numbers); ``prompt`` is filled in when absent."""
    hint = ("GenEval metadata per prompt ('tag', 'include'), e.g. a .jsonl prompt file like Flow-GRPO's "
            "dataset/geneval/train_metadata.jsonl")
    if meta is None:
        raise ValueError(f"{what}: protocol flow_grpo needs {hint}; got no meta")
    out = []
    for i, (m, p) in enumerate(zip(meta, prompts)):
        if not isinstance(m, dict) or not isinstance(m.get("tag"), str) or not isinstance(m.get("include"), list):
            got = sorted(m)[:6] if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"{what}: protocol flow_grpo needs {hint}; meta[{i}] is {got}")
        m = json.loads(json.dumps(m, default=_jsonable))
        m.setdefault("prompt", p)
        out.append(m)
    return out


def parse_geneval_reply(data: Any, n: int, what: str, url: str, geneval_score: str,
                        only_strict: bool) -> RewardOut:
    """Check the GenEval server's reply (``scores``, ``rewards``, ``strict_rewards``: n numbers each;
    ``group_rewards`` / ``group_strict_rewards``: dicts, not used) and pick ``scores`` by ``geneval_score``.
    Components: ``partial``, ``strict`` and (unless ``only_strict``, when the server sends zeros) ``correct``."""
    expected = (f"expected a pickled dict with 'scores', 'rewards', 'strict_rewards' ({n} numbers each) and dicts "
                f"'group_rewards', 'group_strict_rewards' (reward-server app_geneval.py)")
    if not isinstance(data, dict) or not all(k in data for k in ("scores", "rewards", "strict_rewards")):
        got = sorted(map(str, data))[:6] if isinstance(data, dict) else type(data).__name__
        raise MalformedReplyError(f"{what}: reply from {url} is not a GenEval reply (got {got}); {expected}")
    for k in ("group_rewards", "group_strict_rewards"):
        if k in data and not isinstance(data[k], dict):
            raise MalformedReplyError(f"{what}: reply from {url}: '{k}' is {type(data[k]).__name__}; {expected}")
    vals = {name: _vec(data[field], n, field, what, url, expected) for name, field in GENEVAL_SCORES.items()}
    comps = {"partial": vals["partial"], "strict": vals["strict"]}
    if not only_strict:
        comps["correct"] = vals["correct"]
    return RewardOut(vals[geneval_score], comps)


_WARNED_PICKLE: set[str] = set()


# ---------------------------------------------------------------- the client's settings


_URL_FIX = "give reward.url=http://<host>:<port>, e.g. reward.url=http://127.0.0.1:18085"


def check_url(url: Any) -> str:
    """An ``http://`` or ``https://`` URL with a host (and, when given, a port in 1..65535). ``reward.url=notaurl``,
    ``127.0.0.1:18085`` (no scheme), ``ftp://...``, ``http://`` (no host), ``http://h:99999`` or a URL holding
    spaces raise :class:`RemoteConfigError` naming ``reward.url``: urllib would fail only at the first request,
    with a bare OS error, after every retry."""
    if not isinstance(url, str) or not url.strip():
        raise RemoteConfigError(f"reward.url: must be an http(s) URL, got {url!r}; {_URL_FIX}")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise RemoteConfigError(f"reward.url: {url!r} holds spaces or control characters; {_URL_FIX} "
                                f"(percent-encode them in a path)")
    parts = urllib.parse.urlsplit(url)
    if "://" not in url:
        raise RemoteConfigError(f"reward.url: {url!r} has no http:// or https:// scheme; {_URL_FIX}")
    if parts.scheme.lower() not in ("http", "https"):
        raise RemoteConfigError(f"reward.url: {url!r} has the scheme {parts.scheme!r}; the reward services speak "
                                f"http or https: {_URL_FIX}")
    if not parts.hostname:
        raise RemoteConfigError(f"reward.url: {url!r} names no host; {_URL_FIX}")
    try:
        port = parts.port
    except ValueError as e:
        raise RemoteConfigError(f"reward.url: {url!r} has a bad port ({one_line(e, 80)}); the port is a number in "
                                f"1..65535: {_URL_FIX}") from None
    if port == 0:
        raise RemoteConfigError(f"reward.url: {url!r} has port 0, which cannot be connected to; {_URL_FIX}")
    return url


def check_setting(name: str, value: Any, *, integer: bool = False, low: float = 0.0, low_ok: bool = True,
                  high: float | None = None, hint: str = "") -> int | float:
    """A numeric setting ``reward.<name>`` as int / float: a finite number (an integer when ``integer``; bools and
    strings are refused) >= ``low`` (> ``low`` unless ``low_ok``) and <= ``high``; else :class:`RemoteConfigError`
    naming the field, what it must be, and ``hint``."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and math.isfinite(value)
    ok = ok and (float(value).is_integer() if integer else True)
    ok = ok and (value >= low if low_ok else value > low) and (high is None or value <= high)
    if not ok:
        kind = "an integer" if integer else "a finite number"
        bound = f"in {low:g}..{high:g}" if high is not None else f"{'>=' if low_ok else '>'} {low:g}"
        raise RemoteConfigError(f"reward.{name}: must be {kind} {bound}, got {value!r}; give reward.{name}="
                                f"<{hint or kind}>")
    return int(value) if integer else float(value)


def check_headers(headers: Any) -> dict[str, str]:
    """``reward.headers``: a mapping of header names (tokens, no ``:`` or spaces) to values without line breaks
    (a string or number); else :class:`RemoteConfigError` (http.client would refuse it at the first request)."""
    if headers is None:
        return {}
    fix = "give reward.headers={Authorization: 'Bearer <token>'} or reward.headers={}"
    if not isinstance(headers, dict) and not hasattr(headers, "items"):
        raise RemoteConfigError(f"reward.headers: must map header names to values, got {type(headers).__name__}; "
                                f"{fix}")
    out = {}
    for k, v in headers.items():
        if not isinstance(k, str) or not k or any(c in k for c in ": \t\r\n") or not k.isprintable():
            raise RemoteConfigError(f"reward.headers: {k!r} is not a header name; {fix}")
        if isinstance(v, bool) or not isinstance(v, (str, numbers.Real)) or any(c in str(v) for c in "\r\n\0"):
            raise RemoteConfigError(f"reward.headers.{k}: must be a one-line string, got {v!r}; {fix}")
        out[k] = str(v)
    return out


def check_meta(meta: Sequence[Any] | None, n: int, what: str) -> None:
    """Before anything is sent: ``meta`` is None or ``n`` records (JSON objects or None), as the server checks
    (it would answer 400 after the images were encoded and sent)."""
    if meta is None:
        return
    if len(meta) != n:
        raise ValueError(f"{what}: {n} prompts but {len(meta)} meta records; pass one metadata record (or None) "
                         f"per prompt")
    bad = next((i for i, m in enumerate(meta) if m is not None and not isinstance(m, dict)
                and not hasattr(m, "items")), None)
    if bad is not None:
        raise ValueError(f"{what}: meta[{bad}] is a {type(meta[bad]).__name__}; each meta record must be a dict "
                         f"(a JSON object) or None")


# ---------------------------------------------------------------- the client reward


class RemoteReward(Reward):
    """Scores by POSTing batches to a ``stepflow.serve_reward`` service (or any server speaking the protocol).

    url: the endpoint (``http://127.0.0.1:18085``); request_batch_size: images per request; concurrency: requests
    in flight at once; send_meta: include ``meta`` (must be JSON-serializable); headers: extra HTTP headers;
    timeout_s: the longest one attempt may take in total; progress_every_s: a warning every N seconds while a
    request waits (0: off); max_reply_mb: the largest reply read.

    protocol: ``stepflow`` (JSON + PNG, the default) or ``flow_grpo`` (the pickle + JPEG protocol of Flow-GRPO's
    GenEval reward server; see the module docstring). For ``flow_grpo``: geneval_score picks the reply field that
    becomes the reward -- ``partial`` (``scores``, partial credit, what Flow-GRPO trains on), ``strict``
    (``strict_rewards``: exact counts), ``correct`` (``rewards``: GenEval's own rule; needs only_strict=false);
    only_strict is sent as is (true: the server skips the ``correct`` rule and answers zeros there);
    jpeg_quality: of the JPEG images sent. video: the served reward scores videos (its :attr:`modality` is then
    ``"video"``; each video goes as a list of PNG frames).

    Components are whatever the service returns (``flow_grpo``: ``partial``, ``strict``, and ``correct`` unless
    only_strict).
    """

    name = "remote"
    batch_size = 1 << 30  # the whole batch reaches score(); it is split into requests there

    def __init__(self, url: str = "http://127.0.0.1:18085", request_batch_size: int = 64, concurrency: int = 1,
                 timeout_s: float = 120.0, max_retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 send_meta: bool = True, headers: dict[str, str] | None = None, name: str | None = None,
                 progress_every_s: float = 10.0, max_reply_mb: float = 64.0, protocol: str = "stepflow",
                 geneval_score: str = "partial", only_strict: bool = True, jpeg_quality: int = 75,
                 video: bool = False):
        if protocol not in PROTOCOLS:
            raise RemoteConfigError(f"reward.protocol: the protocol must be one of {PROTOCOLS}, got {protocol!r}; "
                                    f"give reward.protocol=stepflow (serve_reward) or reward.protocol=flow_grpo "
                                    f"(Flow-GRPO's reward-server)")
        if geneval_score not in GENEVAL_SCORES:
            raise RemoteConfigError(f"reward.geneval_score: geneval_score must be one of {tuple(GENEVAL_SCORES)}, "
                                    f"got {geneval_score!r}; give reward.geneval_score=partial")
        if protocol == "flow_grpo" and geneval_score == "correct" and only_strict:
            raise RemoteConfigError("reward.geneval_score: geneval_score=correct needs only_strict=false (with "
                                    "only_strict the GenEval server answers 0 for every 'rewards' entry); give "
                                    "reward.only_strict=false")
        if video and protocol != "stepflow":
            raise RemoteConfigError("reward.video: videos travel only in the stepflow protocol (lists of PNG frames); "
                                    "give reward.protocol=stepflow or reward.video=false")
        #: ``video``: the served reward scores videos (B, 3, F, H, W), sent as lists of PNG frames
        self.modality = "video" if video else "image"
        if protocol == "flow_grpo" and not send_meta:
            raise RemoteConfigError("reward.send_meta: protocol flow_grpo always sends the GenEval metadata; give "
                                    "reward.send_meta=true")
        self.url = check_url(url)
        self.request_batch_size = check_setting("request_batch_size", request_batch_size, integer=True, low=1,
                                                hint="images per request, e.g. 64")
        self.concurrency = check_setting("concurrency", concurrency, integer=True, low=1,
                                         hint="requests in flight at once, e.g. 1")
        self.timeout_s = check_setting("timeout_s", timeout_s, low_ok=False, hint="seconds per attempt, e.g. 120")
        self.max_retries = check_setting("max_retries", max_retries, integer=True, hint="retries, e.g. 5 (0: none)")
        self.backoff_s = check_setting("backoff_s", backoff_s, hint="seconds before the first retry, e.g. 1.0")
        self.max_backoff_s = check_setting("max_backoff_s", max_backoff_s, hint="seconds, e.g. 60")
        self.send_meta = bool(send_meta)
        self.headers = check_headers(headers)
        self.progress_every_s = check_setting("progress_every_s", progress_every_s or 0,
                                              hint="seconds between progress warnings, e.g. 10 (0: off)")
        self.max_reply_mb = check_setting("max_reply_mb", max_reply_mb, low_ok=False, hint="MB, e.g. 64")
        self.protocol, self.geneval_score = protocol, geneval_score
        self.only_strict = bool(only_strict)
        self.jpeg_quality = check_setting("jpeg_quality", jpeg_quality, integer=True, low=1, high=100,
                                          hint="JPEG quality, e.g. 75")
        if name:
            self.name = name
        self._sleep: Callable[[float], None] = backoff_wait
        if protocol == "flow_grpo" and url not in _WARNED_PICKLE:
            _WARNED_PICKLE.add(url)
            log.warning("reward %s: protocol flow_grpo (Flow-GRPO's GenEval reward-server) unpickles the replies of "
                        "%s (classes other than plain data are refused, but pickle is not a safe format): use it "
                        "only with a server you trust", self.name, url)

    def describe(self) -> str:
        return f"reward={self.name} served at {self.url}"

    def _post(self, body: bytes, content_type: str, n: int) -> bytes:
        return post(self.url, body, content_type=content_type, timeout_s=self.timeout_s,
                    max_retries=self.max_retries, backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
                    headers=self.headers, what=f"reward {self.name}", sleep=self._sleep,
                    progress_every_s=self.progress_every_s, desc=f"batch {n}", max_reply_mb=self.max_reply_mb)

    def _request(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        what = f"reward {self.name}"
        if self.protocol == "flow_grpo":
            payload = {"images": encode_jpeg(images, self.jpeg_quality),
                       "meta_datas": geneval_meta(meta, prompts, what), "only_strict": self.only_strict}
            raw = self._post(pickle.dumps(payload), "application/octet-stream", len(prompts))
            try:
                data = data_unpickle(raw)
            except Exception as e:  # noqa: BLE001 - anything a hostile or broken pickle raises
                raise MalformedReplyError(f"{what}: POST {self.url} answered what is not a pickle of plain data "
                                          f"({type(e).__name__}: {one_line(e, 120)}); expected the pickled dict of "
                                          f"reward-server app_geneval.py") from None
            return parse_geneval_reply(data, len(prompts), what, self.url, self.geneval_score, self.only_strict)
        payload = {"images": encode_images(images), "prompts": list(prompts),
                   "meta": list(meta) if (meta is not None and self.send_meta) else None}
        raw = self._post(json.dumps(payload, default=_jsonable).encode(), "application/json", len(prompts))
        try:
            data = json.loads(raw)
        except ValueError:
            raise MalformedReplyError(f"{what}: POST {self.url} answered non-JSON ({one_line(raw[:120])!r}); "
                                      f"expected a JSON object") from None
        return parse_reply(data, len(prompts), what, self.url)

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        check_meta(meta, len(prompts), f"reward {self.name}")
        step = self.request_batch_size
        chunks = [(images[i:i + step], prompts[i:i + step], None if meta is None else meta[i:i + step])
                  for i in range(0, len(prompts), step)]
        if not chunks:
            return RewardOut(torch.zeros(0))
        outs = map_interruptible(self._request, chunks, concurrency=self.concurrency, what=f"reward {self.name}",
                                 url=self.url)
        keys = set(outs[0].components)
        if any(set(o.components) != keys for o in outs):
            raise MalformedReplyError(f"reward {self.name}: replies from {self.url} disagree on component names")
        out = RewardOut(torch.cat([o.scores for o in outs]),
                        {k: torch.cat([o.components[k] for o in outs]) for k in sorted(keys)})
        warn_non_finite(out, f"reward {self.name}", self.url)
        return out
