"""Serve any stepflow reward over HTTP (JSON protocol of :mod:`stepflow.rewards.remote`).

    python -m stepflow.serve_reward reward=imagereward port=18087
    python -m stepflow.serve_reward reward=shapes_geneval port=18085     # then train with reward=geneval_server

Standard library only (``http.server.ThreadingHTTPServer``). Requests are scored one at a time (a lock around the
reward), since reward models are not guaranteed thread-safe; run several servers for more throughput.

What a request may cost is bounded before anything is decoded (:class:`Limits`, ``conf/serve_reward.yaml``): the
body size (``Content-Length``, checked before the body is read), the images per request, and the pixels per image
and per request, read from each PNG / JPEG header (a lazy ``PIL.Image.open``) before any pixel is decoded. At most
``decode_workers`` requests decode at once and at most ``max_inflight`` are handled at once (more answer 503, which
clients retry); the reward lock is only taken once a request is fully decoded. Errors answer ``{"error": "<one
line>"}``: 400 malformed (bad JSON, wrong types, empty batch, bad ``Content-Length``, undecodable image), 411 no
``Content-Length``, 413 over a limit, 404 / 501 wrong path or method, 503 busy, 500 the reward failed.
Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stepflow.cli import entry_point
from stepflow.rewards.base import Reward
from stepflow.rewards.errors import one_line

log = logging.getLogger("stepflow.serve_reward")

_EXPECTED = 'expected {"images": [base64 PNG/JPEG], "prompts": [str], "meta": [object|null] | null}'
_DIGITS = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True)
class Limits:
    """What one request may make the server read and decode (``conf/serve_reward.yaml``)."""

    max_body_mb: float = 256.0             # request body (base64 JSON), checked from Content-Length before reading
    max_images: int = 256                  # images per request
    max_image_pixels: int = 4096 * 4096    # width * height of one image, from its header, before decoding
    max_request_pixels: int = 64 * 1024**2  # sum over a request's images (64 images of 1024^2; 768 MB as float32)
    decode_workers: int = 2                # requests decoded at the same time
    max_inflight: int = 16                 # requests handled at the same time (more: 503, retried by clients)
    read_timeout_s: float = 60.0           # a connection that sends nothing for this long is closed

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * 2**20)


class _BadRequest(ValueError):
    """Answered with ``code`` and a one-line ``{"error": ...}``."""

    def __init__(self, msg: str, code: int = 400):
        super().__init__(msg)
        self.code = code


def _parse_request(body: bytes, limits: Limits = Limits()) -> tuple[Any, list[str], list[dict] | None]:
    """Validate a request body and decode its images (within ``limits``); raises :class:`_BadRequest`."""
    from stepflow.rewards.remote import ImageLimitError, decode_images

    try:
        req = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise _BadRequest(f"body is not JSON; {_EXPECTED}") from None
    if not isinstance(req, dict) or not isinstance(req.get("images"), list) or not isinstance(req.get("prompts"), list):
        raise _BadRequest(f"expected a JSON object with lists 'images' (base64 PNG) and 'prompts'; {_EXPECTED}")
    images, prompts, meta = req["images"], req["prompts"], req.get("meta")
    if len(images) != len(prompts):
        raise _BadRequest(f"{len(images)} images but {len(prompts)} prompts")
    if not images:
        raise _BadRequest(f"empty batch: 'images' and 'prompts' need at least one item; {_EXPECTED}")
    if len(images) > limits.max_images:
        raise _BadRequest(f"{len(images)} images in one request; the limit is {limits.max_images} (max_images): "
                          f"send smaller batches (reward.request_batch_size)", 413)
    if not all(isinstance(p, str) for p in prompts):
        raise _BadRequest("'prompts' must be strings")
    if meta is not None and (not isinstance(meta, list) or len(meta) != len(prompts)):
        raise _BadRequest(f"'meta' must be null or a list of {len(prompts)} items")
    if meta is not None and not all(m is None or isinstance(m, dict) for m in meta):
        raise _BadRequest("'meta' items must be JSON objects or null")
    try:
        tensor = decode_images(images, max_image_pixels=limits.max_image_pixels,
                               max_total_pixels=limits.max_request_pixels)
    except ImageLimitError as e:
        raise _BadRequest(one_line(e), 413) from None
    except Exception as e:  # noqa: BLE001 - whatever PIL / base64 raise on hostile input
        raise _BadRequest(f"cannot decode images: {type(e).__name__}: {one_line(e, 200)}") from None
    return tensor, prompts, meta


def make_server(reward: Reward, host: str = "127.0.0.1", port: int = 18085, max_body_mb: float | None = None,
                limits: Limits | None = None, **limit_overrides: Any) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; ``port=0`` picks a free port (``server.server_address[1]``).

    ``limits`` (or keyword overrides of its fields, e.g. ``max_image_pixels=1 << 20``) bound each request."""
    lim = limits or Limits()
    if max_body_mb is not None:
        limit_overrides["max_body_mb"] = max_body_mb
    if limit_overrides:
        lim = Limits(**{**asdict(lim), **limit_overrides})
    lock = threading.Lock()  # around the reward: never held while reading or decoding
    decoding = threading.BoundedSemaphore(max(1, int(lim.decode_workers)))
    inflight = threading.BoundedSemaphore(max(1, int(lim.max_inflight)))
    reward_name = getattr(reward, "name", type(reward).__name__)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = float(lim.read_timeout_s) if lim.read_timeout_s else None  # socket timeout per read / write

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
            log.debug("%s - " + fmt, self.address_string(), *args)

        def _send(self, code: int, obj: Any, close: bool = False) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if close:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            except OSError:  # the client went away
                self.close_connection = True

        def _fail(self, code: int, msg: str, close: bool = False) -> None:
            """A one-line JSON error; ``close`` when the request body was not read (it must not be parsed as the
            next request)."""
            if code >= 500:
                log.warning("%s: %d %s", self.address_string(), code, msg)
            self._send(code, {"error": one_line(msg)}, close=close)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own errors (bad request line, headers too long, unsupported method) as JSON too."""
            self.close_connection = True
            if getattr(self, "request_version", None) in (None, "HTTP/0.9"):  # an unparsable request line: answer
                self.request_version = "HTTP/1.1"  # with a status line and headers all the same
            msg = message or self.responses.get(code, ("error",))[0]
            if code == 501:
                msg = f"method {self.command} not supported; POST / to score, GET /health"
            self._fail(code, msg, close=True)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") in ("/health", ""):
                self._send(200, {"status": "ok", "reward": reward_name})
            else:
                self._fail(404, f"no such path {self.path}; POST / to score, GET /health")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") not in ("", "/score"):
                self._fail(404, f"no such path {self.path}; POST / or /score", close=True)
                return
            if not inflight.acquire(blocking=False):
                self._fail(503, f"busy: {lim.max_inflight} requests in flight (max_inflight); retry later", close=True)
                return
            try:
                self._score()
            finally:
                inflight.release()

        def _content_length(self) -> int | None:
            """The declared body size, or None after answering the error (400 / 411 / 413)."""
            if self.headers.get("Transfer-Encoding"):
                self._fail(411, "chunked request bodies are not supported; send Content-Length", close=True)
                return None
            values = self.headers.get_all("Content-Length") or []
            if not values:
                self._fail(411, f"missing Content-Length; {_EXPECTED}", close=True)
                return None
            raw = values[0].strip()
            if len(set(v.strip() for v in values)) > 1 or not _DIGITS.fullmatch(raw):
                self._fail(400, f"bad Content-Length {one_line(', '.join(values), 40)!r}: expected one byte count",
                           close=True)
                return None
            n = int(raw)
            if n == 0:
                self._fail(400, f"empty body; {_EXPECTED}")
                return None
            if n > lim.max_body:
                self._fail(413, f"body of {n} bytes is over the limit of {lim.max_body} bytes (max_body_mb="
                                f"{lim.max_body_mb:g}): send smaller batches (reward.request_batch_size)", close=True)
                return None
            return n

        def _score(self) -> None:
            n = self._content_length()
            if n is None:
                return
            try:
                body = self.rfile.read(n)
            except TimeoutError:
                self._fail(408, f"request body not received within {lim.read_timeout_s:g} s", close=True)
                return
            if len(body) < n:  # the client closed before sending what it declared: nobody to answer
                self.close_connection = True
                return
            try:
                with decoding:
                    images, prompts, meta = _parse_request(body, lim)
            except _BadRequest as e:
                self._fail(e.code, str(e))
                return
            del body
            try:
                with lock:
                    out = reward(images, prompts, meta)
                if tuple(out.scores.shape) != (len(prompts),):
                    raise ValueError(f"reward returned scores of shape {tuple(out.scores.shape)} for {len(prompts)} "
                                     f"images")
            except Exception as e:  # noqa: BLE001 - the client gets a one-line 500, the server log the traceback
                log.exception("reward failed")
                self._fail(500, f"{type(e).__name__}: {one_line(e)}")
                return
            self._send(200, {"scores": out.scores.float().tolist(),
                             "components": {k: v.float().tolist() for k, v in out.components.items()}})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.limits = lim  # type: ignore[attr-defined]
    return server


def serve(reward: Reward, host: str, port: int, max_body_mb: float | None = None, limits: Limits | None = None,
          **limit_overrides: Any) -> None:
    server = make_server(reward, host, port, max_body_mb, limits, **limit_overrides)
    log.info("serving reward %s on http://%s:%d (limits: %s)", getattr(reward, "name", "?"),
             *server.server_address[:2], server.limits)  # type: ignore[attr-defined]
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def limits_from_config(cfg: Any) -> Limits:
    """The :class:`Limits` fields present in a config node (``conf/serve_reward.yaml``); the rest keep defaults."""
    fields = Limits.__dataclass_fields__
    return Limits(**{k: type(getattr(Limits, k))(cfg[k]) for k in fields if cfg.get(k) is not None})


@entry_point("serve_reward")
def main(cfg) -> None:
    from stepflow.rewards.registry import build_reward

    serve(build_reward(cfg.reward), cfg.host, int(cfg.port), limits=limits_from_config(cfg))


if __name__ == "__main__":
    main()
