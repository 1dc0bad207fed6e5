"""Serve any stepflow reward over HTTP (JSON protocol of :mod:`stepflow.rewards.remote`).

    python -m stepflow.serve_reward reward=imagereward port=18087
    python -m stepflow.serve_reward reward=shapes_geneval port=18085     # then train with reward=geneval_server

Standard library only (``http.server.ThreadingHTTPServer``). Requests are scored one at a time (a lock around the
reward), since reward models are not guaranteed thread-safe; run several servers for more throughput.
Bad requests answer 400, reward failures 500, each with ``{"error": "<one line>"}``; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from stepflow.rewards.base import Reward
from stepflow.rewards.errors import one_line

log = logging.getLogger("stepflow.serve_reward")


class _BadRequest(ValueError):
    pass


def _parse_request(body: bytes) -> tuple[Any, list[str], list[dict] | None]:
    from stepflow.rewards.remote import decode_images

    try:
        req = json.loads(body)
    except ValueError:
        raise _BadRequest("body is not JSON; expected {\"images\": [base64 PNG], \"prompts\": [str], \"meta\": [...]}") from None
    if not isinstance(req, dict) or not isinstance(req.get("images"), list) or not isinstance(req.get("prompts"), list):
        raise _BadRequest("expected a JSON object with lists 'images' (base64 PNG) and 'prompts'")
    images, prompts, meta = req["images"], req["prompts"], req.get("meta")
    if len(images) != len(prompts):
        raise _BadRequest(f"{len(images)} images but {len(prompts)} prompts")
    if not all(isinstance(p, str) for p in prompts):
        raise _BadRequest("'prompts' must be strings")
    if meta is not None and (not isinstance(meta, list) or len(meta) != len(prompts)):
        raise _BadRequest(f"'meta' must be null or a list of {len(prompts)} items")
    try:
        tensor = decode_images(images)
    except Exception as e:  # noqa: BLE001
        raise _BadRequest(f"cannot decode images: {type(e).__name__}: {e}") from None
    return tensor, prompts, meta


def make_server(reward: Reward, host: str = "127.0.0.1", port: int = 18085,
                max_body_mb: float = 1024.0) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; ``port=0`` picks a free port (``server.server_address[1]``)."""
    lock = threading.Lock()
    max_body = int(max_body_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
            log.debug("%s - " + fmt, self.address_string(), *args)

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") in ("/health", ""):
                self._send(200, {"status": "ok", "reward": getattr(reward, "name", type(reward).__name__)})
            else:
                self._send(404, {"error": f"no such path {self.path}; POST / to score, GET /health"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") not in ("", "/score"):
                self._send(404, {"error": f"no such path {self.path}; POST / or /score"})
                return
            n = int(self.headers.get("Content-Length") or 0)
            if n <= 0 or n > max_body:
                self._send(400 if n <= 0 else 413, {"error": f"bad Content-Length {n} (limit {max_body} bytes)"})
                return
            body = self.rfile.read(n)
            try:
                images, prompts, meta = _parse_request(body)
            except _BadRequest as e:
                self._send(400, {"error": one_line(e)})
                return
            try:
                with lock:
                    out = reward(images, prompts, meta)
            except Exception as e:  # noqa: BLE001 - the client gets a one-line 500, the server log the traceback
                log.exception("reward failed")
                self._send(500, {"error": f"{type(e).__name__}: {one_line(e)}"})
                return
            self._send(200, {"scores": out.scores.float().tolist(),
                             "components": {k: v.float().tolist() for k, v in out.components.items()}})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve(reward: Reward, host: str, port: int, max_body_mb: float = 1024.0) -> None:
    server = make_server(reward, host, port, max_body_mb)
    log.info("serving reward %s on http://%s:%d", getattr(reward, "name", "?"), *server.server_address[:2])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def main() -> None:
    import hydra

    from stepflow.cli import CONF_DIR
    from stepflow.rewards.registry import build_reward

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="serve_reward")
    def _run(cfg) -> None:
        serve(build_reward(cfg.reward), cfg.host, int(cfg.port), float(cfg.max_body_mb))

    _run()


if __name__ == "__main__":
    main()
