"""Serve any stepflow reward over HTTP (JSON protocol of :mod:`stepflow.rewards.remote`).

    python -m stepflow.serve_reward reward=imagereward port=18087
    python -m stepflow.serve_reward reward=shapes_geneval port=18085     # then train with reward=geneval_server

Standard library only (``http.server.ThreadingHTTPServer``). Requests are scored one at a time (a lock around the
reward), since reward models are not guaranteed thread-safe; run several servers for more throughput.

Start-up checks, before the reward is built (one line ``stepflow: error: <field>: ...`` each, never a traceback):
every limit below is a positive, finite number (counts are integers >= 1; :func:`check_limit`), ``port`` is an
integer in 0..65535 (0: a free one), ``host`` resolves and ``host:port`` can be bound (:func:`check_bind`: a port in
use, a privileged port, an address that is not this machine's are named as such).

What a request may cost is bounded before anything is decoded (:class:`Limits`, in ``stepflow.config``): the
body size (``Content-Length``, checked before the body is read), the images per request, and the pixels per image
and per request, read from each PNG / JPEG header (a lazy ``PIL.Image.open``) before any pixel is decoded. At most
``decode_workers`` requests decode at once and at most ``max_inflight`` are handled at once (more answer 503, which
clients retry); the reward lock is only taken once a request is fully decoded. The lock is held while the reward
scores a request, and that time grows with the request's pixels: the shapes judge (``reward=shapes_geneval``) needs
about 1 s per megapixel of noise-like samples on one CPU core (15-22 s for one 4096^2 image, the old default
limit), which is why ``max_image_pixels`` defaults to 2048^2 (4 Mpx: 3-4 s at worst; sd35_large's 1024^2 samples:
under 1 s). A request's total, and so the longest any request holds the lock, is bounded by
``max_request_pixels`` (64 Mpx by default: a minute of shapes judging for noise; lower it, or run more servers,
where one client must not wait on another's large batches).

Errors answer ``{"error": "<one line>"}``: 400 malformed (bad JSON, wrong types, empty batch, ``meta`` that is not
a list of one object or null per image, bad ``Content-Length``, undecodable image), 411 no ``Content-Length``, 413
over a limit, 404 / 501 wrong path or method, 422 the reward refused the request's content (a ValueError /
KeyError / TypeError of the reward, e.g. metadata it cannot judge; clients do not retry it), 503 busy, 500 the
reward failed otherwise (clients retry). Nothing is ever unpickled.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import socket
import threading
from dataclasses import dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stepflow.cli import check_finite, entry_point

# the limits, their checks and the whole config live in stepflow.config (the schema Hydra composes); Limits and
# check_limit are re-exported here
from stepflow.config import Limits, ServeRewardConfig, check_host, check_limit, check_port, to_config  # noqa: F401
from stepflow.errors import StepflowError, one_line
from stepflow.rewards.base import Reward

log = logging.getLogger("stepflow.serve_reward")

_EXPECTED = ('expected {"images": [base64 PNG/JPEG (a video: a list of them)], "prompts": [str], '
             '"meta": [object|null] | null}')
_DIGITS = re.compile(r"[0-9]{1,18}")


def _family(host: str, port: int) -> socket.AddressFamily:
    """The address family to bind ``host`` with (IPv4 first; ``::1`` / ``::`` are IPv6); a one-line StepflowError
    naming ``host`` when it is no string or does not resolve."""
    check_host(host)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, OSError) as e:
        raise StepflowError(f"host: cannot resolve {host!r} ({one_line(getattr(e, 'strerror', None) or e, 120)}); "
                            f"give host=127.0.0.1 (this machine only), host=0.0.0.0 (every interface) or an address "
                            f"of this machine") from None
    families = [i[0] for i in infos]
    return socket.AF_INET if socket.AF_INET in families else families[0]


def bind_error(e: OSError, host: str, port: int) -> StepflowError:
    """One line for a failed bind of ``host:port``, naming ``port`` or ``host`` (whichever is at fault) and the fix."""
    code = e.errno
    if code == errno.EADDRINUSE:
        return StepflowError(f"port: port {port} is in use on {host} (another server?); choose another port= or "
                             f"port=0 for a free one")
    if code == errno.EACCES:
        return StepflowError(f"port: no permission to bind port {port} on {host} (ports below 1024 need root); "
                             f"choose a port >= 1024, e.g. port=18085, or port=0 for a free one")
    if code == errno.EADDRNOTAVAIL:
        return StepflowError(f"host: {host} is not an address of this machine, so it cannot be bound; give "
                             f"host=127.0.0.1 (this machine only), host=0.0.0.0 (every interface) or one of its "
                             f"addresses")
    return StepflowError(f"host: cannot bind {host}:{port} ({type(e).__name__}: {one_line(e, 120)}); check host= "
                         f"and port= (port=0 picks a free port)")


def _server_class(host: str, port: int) -> type[ThreadingHTTPServer]:
    """ThreadingHTTPServer for the address family of ``host`` (checked: :func:`check_port`, :func:`_family`)."""
    family = _family(host, check_port(port))
    if family == ThreadingHTTPServer.address_family:
        return ThreadingHTTPServer
    return type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": family})


def check_bind(host: str, port: int) -> None:
    """Fail early (before a reward model is loaded) when ``host:port`` cannot be served: the port is checked
    (0..65535), the host resolved, and the address bound once and released (the same socket options as the
    server's). Raises a one-line StepflowError naming ``port`` or ``host``."""
    cls = _server_class(host, port)
    try:
        probe = cls((host, port), BaseHTTPRequestHandler, bind_and_activate=False)
    except OSError as e:
        raise bind_error(e, host, port) from None
    try:
        probe.server_bind()
    except OSError as e:
        raise bind_error(e, host, port) from None
    finally:
        probe.server_close()


#: what a reward raises when it cannot use the client's input (metadata it cannot judge, ...): answered 422, which
#: clients do not retry; anything else the reward raises is a 500 (retried)
_REFUSED = (ValueError, KeyError, TypeError)


class _BadRequest(ValueError):
    """Answered with ``code`` and a one-line ``{"error": ...}``."""

    def __init__(self, msg: str, code: int = 400):
        super().__init__(msg)
        self.code = code


def _parse_request(body: bytes, limits: Limits | None = None) -> tuple[Any, list[str], list[dict] | None]:
    """Validate a request body and decode its images (within ``limits``, default :class:`Limits`); raises
    :class:`_BadRequest`."""
    from stepflow.rewards.remote import ImageLimitError, decode_images, decode_videos

    limits = limits or Limits()
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
        decode = decode_videos if any(isinstance(x, list) for x in images) else decode_images  # a list: a video
        tensor = decode(images, max_image_pixels=limits.max_image_pixels, max_total_pixels=limits.max_request_pixels)
    except ImageLimitError as e:
        raise _BadRequest(one_line(e), 413) from None
    except Exception as e:  # noqa: BLE001 - whatever PIL / base64 raise on hostile input
        raise _BadRequest(f"cannot decode images: {type(e).__name__}: {one_line(e, 200)}") from None
    return tensor, prompts, meta


@dataclass(frozen=True)
class _Scoring:
    """What every request of one server shares: the reward and its lock (never held while reading or decoding),
    the limits, and the semaphores that bound the decodes and the requests handled at once."""

    reward: Reward
    limits: Limits
    lock: threading.Lock
    decoding: threading.BoundedSemaphore
    inflight: threading.BoundedSemaphore
    reward_name: str

    @classmethod
    def build(cls, reward: Reward, lim: Limits) -> _Scoring:
        """A fresh lock and semaphores sized by ``lim`` (``decode_workers``, ``max_inflight``) for ``reward``."""
        return cls(reward, lim, threading.Lock(), threading.BoundedSemaphore(lim.decode_workers),
                   threading.BoundedSemaphore(lim.max_inflight), getattr(reward, "name", type(reward).__name__))


#: what :meth:`_Handler._run_reward` returns once it has answered the request itself (422 / 500)
_ANSWERED = object()


class _Handler(BaseHTTPRequestHandler):
    """One connection of the reward server (JSON in and out); :func:`_handler_class` binds it to a
    :class:`_Scoring` and sets the socket timeout per read / write (``read_timeout_s``)."""

    protocol_version = "HTTP/1.1"
    scoring: _Scoring  # set by _handler_class

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
            self._send(200, {"status": "ok", "reward": self.scoring.reward_name})
        else:
            self._fail(404, f"no such path {self.path}; POST / to score, GET /health")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") not in ("", "/score"):
            self._fail(404, f"no such path {self.path}; POST / or /score", close=True)
            return
        inflight = self.scoring.inflight
        if not inflight.acquire(blocking=False):
            self._fail(503, f"busy: {self.scoring.limits.max_inflight} requests in flight (max_inflight); retry "
                            f"later", close=True)
            return
        try:
            self._score()
        finally:
            inflight.release()

    def _content_length(self) -> int | None:
        """The declared body size, or None after answering the error (400 / 411 / 413)."""
        lim = self.scoring.limits
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

    def _read_body(self) -> bytes | None:
        """The request body (:meth:`_content_length` checked first), or None after answering the error, or when
        the client closed before sending what it declared (nobody to answer)."""
        n = self._content_length()
        if n is None:
            return None
        try:
            body = self.rfile.read(n)
        except TimeoutError:
            self._fail(408, f"request body not received within {self.scoring.limits.read_timeout_s:g} s", close=True)
            return None
        if len(body) < n:  # the client closed before sending what it declared: nobody to answer
            self.close_connection = True
            return None
        return body

    def _run_reward(self, images: Any, prompts: list[str], meta: list[dict] | None) -> Any:
        """The reward's output (under the lock), or :data:`_ANSWERED` after answering 422 (it refused the
        request's content) or 500 (it failed otherwise)."""
        try:
            with self.scoring.lock:
                return self.scoring.reward(images, prompts, meta)
        except _REFUSED as e:  # the reward cannot use what the client sent (its metadata, prompts): 422
            log.info("%s: 422 the reward refused the request: %s: %s", self.address_string(), type(e).__name__,
                     one_line(e))
            self._fail(422, f"the reward cannot score this request ({type(e).__name__}: {one_line(e)}); check "
                            f"the request's prompts and meta (e.g. GenEval metadata 'tag', 'include')")
        except Exception as e:  # noqa: BLE001 - the client gets a one-line 500, the server log the traceback
            log.exception("reward failed")
            self._fail(500, f"{type(e).__name__}: {one_line(e)}")
        return _ANSWERED

    def _score(self) -> None:
        body = self._read_body()
        if body is None:
            return
        try:
            with self.scoring.decoding:
                images, prompts, meta = _parse_request(body, self.scoring.limits)
        except _BadRequest as e:
            self._fail(e.code, str(e))
            return
        del body
        out = self._run_reward(images, prompts, meta)
        if out is _ANSWERED:
            return
        if tuple(out.scores.shape) != (len(prompts),):  # the server's fault, not the client's
            self._fail(500, f"ValueError: reward returned scores of shape {tuple(out.scores.shape)} for "
                            f"{len(prompts)} images")
            return
        self._send(200, {"scores": out.scores.float().tolist(),
                         "components": {k: v.float().tolist() for k, v in out.components.items()}})


def _handler_class(reward: Reward, lim: Limits) -> type[_Handler]:
    """A :class:`_Handler` subclass for one server: its own :class:`_Scoring` (lock, semaphores) and socket
    timeout."""
    return type("Handler", (_Handler,), {"scoring": _Scoring.build(reward, lim), "timeout": lim.read_timeout_s})


def _merged_limits(limits: Limits | None, max_body_mb: float | None, overrides: dict[str, Any]) -> Limits:
    """``limits`` (default :class:`Limits`) with ``max_body_mb`` and the keyword ``overrides`` of its fields, all
    checked by :class:`Limits` itself."""
    lim = limits or Limits()
    if max_body_mb is not None:
        overrides["max_body_mb"] = max_body_mb
    if overrides:
        lim = Limits(**{**{f.name: getattr(lim, f.name) for f in fields(Limits)}, **overrides})
    return lim


def make_server(reward: Reward, host: str = "127.0.0.1", port: int = 18085, max_body_mb: float | None = None,
                limits: Limits | None = None, **limit_overrides: Any) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; ``port=0`` picks a free port (``server.server_address[1]``).

    ``limits`` (or keyword overrides of its fields, e.g. ``max_image_pixels=1 << 20``) bound each request; they are
    checked (:func:`check_limit`) before anything is bound. A bad ``port``, a ``host`` that does not resolve and a
    failed bind (port in use, ...) raise a one-line StepflowError naming ``port`` / ``host``."""
    lim = _merged_limits(limits, max_body_mb, limit_overrides)
    server_class = _server_class(host, port)
    handler = _handler_class(reward, lim)
    try:
        server = server_class((host, port), handler)
    except OSError as e:
        raise bind_error(e, host, port) from None
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
    """The :class:`Limits` fields present in a config node (``conf/serve_reward.yaml``, or any part of one), each
    checked by :func:`check_limit` (a one-line StepflowError naming the field); the rest keep defaults. The entry
    point reads the whole config with :func:`settings`."""
    return Limits(**{f.name: cfg[f.name] for f in fields(Limits) if cfg.get(f.name) is not None})


def settings(cfg: Any) -> ServeRewardConfig:
    """The composed ``conf/serve_reward.yaml`` as its typed :class:`ServeRewardConfig`: every limit
    (:func:`check_limit`), ``host`` and ``port`` (:func:`check_port`) checked, a one-line StepflowError naming the
    field otherwise (``max_images: must be an integer >= 1, got 0; ...``)."""
    if isinstance(cfg, ServeRewardConfig):
        return cfg
    check_finite(cfg)
    return to_config(cfg, ServeRewardConfig)


@entry_point("serve_reward")
def main(cfg) -> None:
    from stepflow.rewards.registry import build_reward

    s = settings(cfg)  # every check before the reward is built (a model can take minutes to load)
    check_bind(s.host, s.port)
    serve(build_reward(s.reward), s.host, s.port, limits=s.limits)


if __name__ == "__main__":
    main()
