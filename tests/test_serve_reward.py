"""``stepflow.serve_reward`` against hostile input, on 127.0.0.1: images refused from their header (pixels per image
and per request, images per request) before any pixel is decoded, malformed requests (``Content-Length``, JSON,
types, empty batch, undecodable images, wrong path / method, a body that never comes) answered 4xx with one-line
JSON in a few seconds, a busy server answering 503, the limits read from conf/serve_reward.yaml, and a small load
test (8 threads x 10 requests, valid and malformed mixed) where every valid request gets its exact scores. At start:
limits that refuse everything (0, -1, inf, nan, not a number), a bad port, a port in use and a host that cannot be
bound are one line naming the field, before the reward is built; metadata the reward cannot use is a 422, not a 500
(which clients retry)."""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from stepflow.errors import StepflowError
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import to_uint8
from stepflow.testing.harness import one_line_error as _cli_error
from stepflow.testing.harness import run_cli

FEW_S = 5.0  # "answers within a few seconds" on a shared 2-core machine


class MeanReward(Reward):
    """score = mean uint8 pixel / 255 + 0.01 * len(prompt); records the image sizes it saw."""

    name = "mean"

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def score(self, images, prompts, meta):
        self.seen.append(tuple(images.shape[-2:]))
        u8 = torch.from_numpy(to_uint8(images)).float()
        return RewardOut(u8.mean(dim=(1, 2, 3)) / 255 + 0.01 * torch.tensor([float(len(p)) for p in prompts]))


class Server:
    def __init__(self, reward: Reward, **limits):
        from stepflow.serve_reward import make_server

        self.reward = reward
        self.httpd = make_server(reward, "127.0.0.1", 0, **limits)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = FEW_S) -> tuple[int, dict | str, float]:
    """Send bytes as they are; return (status, JSON body (or text), seconds to the reply). Status 0: no reply."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        data = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if b"\r\n\r\n" in data:
                    hdr, _, rest = data.partition(b"\r\n\r\n")
                    lens = [int(x.split(b":")[1]) for x in hdr.split(b"\r\n") if x.lower().startswith(b"content-length:")]
                    if lens and len(rest) >= lens[0]:
                        break
        except (ConnectionResetError, TimeoutError):
            pass
    dt = time.monotonic() - t0
    if not data.startswith(b"HTTP/"):
        return 0, data.decode(errors="replace"), dt
    status = int(data.split(b" ", 2)[1])
    text = data.partition(b"\r\n\r\n")[2].decode(errors="replace")
    try:
        return status, json.loads(text), dt
    except ValueError:
        return status, text, dt


def post(port: int, body: bytes | dict, headers: dict[str, str] | None = None) -> tuple[int, dict | str, float]:
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    hdrs = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    head = "POST / HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items() if v is not None) + "\r\n"
    return raw_request(port, head.encode(), body)


def png(w: int, h: int, value: int = 0, rows: int | None = None) -> bytes:
    """A valid RGB PNG of w x h pixels of one grey value, compressed row by row (a 12000^2 one is ~410 KB);
    ``rows``: pixel data for only that many rows (a header that promises more than the data holds)."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    c = zlib.compressobj(6)
    row = b"\x00" + bytes([value]) * (3 * w)
    idat = b"".join(c.compress(row) for _ in range(h if rows is None else rows)) + c.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def img_b64(a: np.ndarray, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format=fmt)
    return b64(buf.getvalue())


def valid(n: int = 2, seed: int = 0, size: int = 8) -> tuple[dict, list[float]]:
    """A valid request and the scores MeanReward gives it."""
    rng = np.random.default_rng(seed)
    arrs = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
    prompts = [f"p{'x' * ((seed + i) % 5)}" for i in range(n)]
    expected = [float(np.float32(a.astype(np.float32).mean() / 255) + np.float32(0.01) * len(p))
                for a, p in zip(arrs, prompts)]
    return {"images": [img_b64(a) for a in arrs], "prompts": prompts}, expected


def assert_one_line_error(status: int, body, lo: int = 400, hi: int = 499, needle: str = ""):
    assert lo <= status <= hi, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert "\n" not in body["error"] and needle.lower() in body["error"].lower(), body


@pytest.fixture(scope="module")
def huge_png() -> bytes:
    data = png(12000, 12000)
    assert len(data) < 1_000_000  # a small body: only the header tells how big it is
    return data


@pytest.fixture
def no_big_decode(monkeypatch):
    """Make decoding an image over 4096^2 pixels fail loudly (so a test never allocates gigabytes)."""
    decoded = []
    load = ImageFile.ImageFile.load

    def guarded(self):
        if self.size[0] * self.size[1] > 4096 * 4096:
            decoded.append(self.size)
            raise MemoryError(f"test guard: refused to decode a {self.size[0]}x{self.size[1]} image")
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", guarded)
    return decoded


# ---------------------------------------------------------------- limits, from the header


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_huge_png_is_refused_from_its_header(huge_png, no_big_decode):
    """A 410 KB PNG of 12000 x 12000 pixels: 413 in milliseconds, nothing decoded, the server goes on serving."""
    with Server(MeanReward()) as srv:
        body = {"images": [b64(huge_png)], "prompts": ["a photo of a circle"]}
        status, reply, dt = post(srv.port, body)
        assert_one_line_error(status, reply, 413, 413, "12000x12000")
        assert "max_image_pixels" in reply["error"] and dt < FEW_S
        assert no_big_decode == [] and srv.reward.seen == []
        req, expected = valid(2)
        status, reply, _ = post(srv.port, req)
        assert status == 200 and reply["scores"] == pytest.approx(expected)


def test_image_over_pil_bomb_limit_is_a_413(no_big_decode):
    """Past PIL's own decompression-bomb limit (2 x Image.MAX_IMAGE_PIXELS) open() itself refuses: still a 413."""
    side = int((2 * Image.MAX_IMAGE_PIXELS) ** 0.5) + 16
    with Server(MeanReward(), max_image_pixels=10**12, max_request_pixels=10**12) as srv:
        status, reply, _ = post(srv.port, {"images": [b64(png(side, side, rows=1))], "prompts": ["x"]})
    assert_one_line_error(status, reply, 413, 413)
    assert no_big_decode == []


def test_pixel_and_image_count_limits():
    a32 = np.zeros((32, 32, 3), np.uint8)
    with Server(MeanReward(), max_images=4, max_image_pixels=32 * 32, max_request_pixels=3 * 32 * 32) as srv:
        status, reply, _ = post(srv.port, {"images": [img_b64(a32)] * 5, "prompts": ["x"] * 5})
        assert_one_line_error(status, reply, 413, 413, "max_images")
        status, reply, _ = post(srv.port, {"images": [img_b64(np.zeros((33, 32, 3), np.uint8))], "prompts": ["x"]})
        assert_one_line_error(status, reply, 413, 413, "max_image_pixels")
        status, reply, _ = post(srv.port, {"images": [img_b64(a32)] * 4, "prompts": ["x"] * 4})
        assert_one_line_error(status, reply, 413, 413, "max_request_pixels")
        status, reply, _ = post(srv.port, {"images": [img_b64(a32)] * 3, "prompts": ["x"] * 3})
        assert status == 200 and len(reply["scores"]) == 3
        assert srv.reward.seen == [(32, 32)]  # only the valid request reached the reward


def test_body_limit_is_checked_before_reading():
    """A declared body over max_body_mb is refused at once, without waiting for (or reading) the body."""
    with Server(MeanReward(), max_body_mb=1) as srv:
        head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n"
        status, reply, dt = raw_request(srv.port, head)  # no body sent at all
        assert_one_line_error(status, reply, 413, 413, "max_body_mb")
        assert dt < FEW_S


# ---------------------------------------------------------------- malformed requests


def _gif() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="GIF")
    return b64(buf.getvalue())


_A8 = img_b64(np.zeros((8, 8, 3), np.uint8))
_HDR = "POST / HTTP/1.1\r\nHost: x\r\n"

#: name -> (raw request bytes, expected status)
MALFORMED = {
    "content_length_abc": ((_HDR + "Content-Length: abc\r\n\r\n").encode() + b"{}", 400),
    "content_length_negative": ((_HDR + "Content-Length: -5\r\n\r\n").encode(), 400),
    "content_length_float": ((_HDR + "Content-Length: 2.5\r\n\r\n").encode() + b"{}", 400),
    "content_length_conflict": ((_HDR + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n").encode() + b"{}", 400),
    "content_length_missing": ((_HDR + "\r\n").encode(), 411),
    "content_length_zero": ((_HDR + "Content-Length: 0\r\n\r\n").encode(), 400),
    "chunked": ((_HDR + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"2\r\n{}\r\n0\r\n\r\n", 411),
    "not_json": (b"<html>", 400),
    "not_utf8": (b"\xff\xfe\x00{", 400),
    "json_list": (b"[1, 2]", 400),
    "deep_json": (b"[" * 100000 + b"]" * 100000, 400),
    "images_not_list": ({"images": "abc", "prompts": ["x"]}, 400),
    "missing_prompts": ({"images": [_A8]}, 400),
    "empty_batch": ({"images": [], "prompts": []}, 400),
    "length_mismatch": ({"images": [_A8, _A8], "prompts": ["x"]}, 400),
    "prompt_not_str": ({"images": [_A8], "prompts": [3]}, 400),
    "meta_wrong_length": ({"images": [_A8], "prompts": ["x"], "meta": [{}, {}]}, 400),
    "meta_item_not_object": ({"images": [_A8], "prompts": ["x"], "meta": [7]}, 400),
    "meta_item_list": ({"images": [_A8], "prompts": ["x"], "meta": [[{"tag": "x"}]]}, 400),
    "meta_not_list": ({"images": [_A8], "prompts": ["x"], "meta": {"tag": "single_object"}}, 400),
    "meta_string": ({"images": [_A8], "prompts": ["x"], "meta": "single_object"}, 400),
    "image_not_str": ({"images": [123], "prompts": ["x"]}, 400),
    "image_not_base64": ({"images": ["@@@not base64@@@"], "prompts": ["x"]}, 400),
    "image_not_image": ({"images": [b64(b"hello world, not an image")], "prompts": ["x"]}, 400),
    "image_gif": ({"images": [_gif()], "prompts": ["x"]}, 400),
    "image_truncated": ({"images": [b64(png(64, 64, 9)[:60])], "prompts": ["x"]}, 400),
    "images_of_two_sizes": ({"images": [_A8, img_b64(np.zeros((9, 8, 3), np.uint8))], "prompts": ["x", "y"]}, 400),
    "too_many_images": ({"images": [_A8] * 9, "prompts": ["x"] * 9}, 413),
    "too_many_pixels": ({"images": [img_b64(np.zeros((128, 128, 3), np.uint8))], "prompts": ["x"]}, 413),
    "wrong_path": (b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404),
    "put": (b"PUT / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 501),
    "bad_request_line": (b"GARBAGE / HTTP/1.1 extra\r\n\r\n", 400),
}
LIMITS = {"max_images": 8, "max_image_pixels": 64 * 64}


def _raw(item) -> bytes:
    if isinstance(item, bytes) and item[:5] in (b"POST ", b"PUT /", b"GARBA"):
        return item
    body = json.dumps(item).encode() if isinstance(item, dict) else item
    return (_HDR + f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_request_is_a_one_line_4xx(name):
    item, code = MALFORMED[name]
    with Server(MeanReward(), **LIMITS) as srv:
        status, reply, dt = raw_request(srv.port, _raw(item))
        assert_one_line_error(status, reply, code, code)
        assert dt < FEW_S
        assert srv.reward.seen == []
        req, expected = valid(1)  # and the server goes on serving
        status, reply, _ = post(srv.port, req)
        assert status == 200 and reply["scores"] == pytest.approx(expected)


def test_a_body_that_never_comes_is_dropped():
    """Content-Length promises 100 bytes, nothing follows: the connection is answered 408 and closed after
    read_timeout_s, and other clients are served meanwhile."""
    with Server(MeanReward(), read_timeout_s=0.5) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=FEW_S) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            req, expected = valid(1)
            status, reply, _ = post(srv.port, req)
            assert status == 200 and reply["scores"] == pytest.approx(expected)
            t0 = time.monotonic()
            data = b""
            while chunk := s.recv(4096):  # until the server closes the connection
                data += chunk
            assert time.monotonic() - t0 < FEW_S
        assert data.startswith(b"HTTP/1.1 408") and b'{"error": "request body not received' in data


def test_decoding_does_not_wait_for_the_reward_lock(monkeypatch):
    """While the reward is busy with one request, another is read and decoded, and a malformed one is answered 4xx
    at once."""
    import stepflow.rewards.remote as remote

    entered, release = threading.Event(), threading.Event()
    decoded_while_busy = threading.Event()
    real_decode = remote.decode_images

    class Blocking(MeanReward):
        def score(self, images, prompts, meta):
            entered.set()
            assert release.wait(30)
            return super().score(images, prompts, meta)

    def spy(*a, **kw):
        if entered.is_set() and not release.is_set():
            decoded_while_busy.set()
        return real_decode(*a, **kw)

    monkeypatch.setattr(remote, "decode_images", spy)
    with Server(Blocking()) as srv:
        results = {}
        req, expected = valid(2)
        ta = threading.Thread(target=lambda: results.update(a=post(srv.port, req)))
        ta.start()
        try:
            assert entered.wait(FEW_S)
            tb = threading.Thread(target=lambda: results.update(b=post(srv.port, req)))
            tb.start()
            assert decoded_while_busy.wait(FEW_S)  # b is decoded while a holds the reward lock
            status, reply, dt = post(srv.port, {"images": [], "prompts": []})
            assert_one_line_error(status, reply, 400, 400, "empty batch")
            assert dt < FEW_S
        finally:
            release.set()
        ta.join(FEW_S)
        tb.join(FEW_S)
        assert results["a"][0] == 200 and results["b"][0] == 200
        assert results["a"][1]["scores"] == pytest.approx(expected) == results["b"][1]["scores"]


def test_over_max_inflight_is_a_503():
    entered, release = threading.Event(), threading.Event()

    class Blocking(MeanReward):
        def score(self, images, prompts, meta):
            entered.set()
            assert release.wait(30)
            return super().score(images, prompts, meta)

    with Server(Blocking(), max_inflight=1) as srv:
        req, expected = valid(1)
        results = {}
        t = threading.Thread(target=lambda: results.update(a=post(srv.port, req)))
        t.start()
        try:
            assert entered.wait(FEW_S)
            status, reply, dt = post(srv.port, req)
            assert_one_line_error(status, reply, 503, 503, "max_inflight")
            assert dt < FEW_S
        finally:
            release.set()
        t.join(FEW_S)
        assert results["a"][0] == 200 and results["a"][1]["scores"] == pytest.approx(expected)


def test_json_error_for_http_server_errors():
    with Server(MeanReward()) as srv:
        status, reply, _ = raw_request(srv.port, b"DELETE / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert_one_line_error(status, reply, 501, 501, "DELETE")
        status, reply, _ = raw_request(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and reply == {"status": "ok", "reward": "mean"}


# ---------------------------------------------------------------- config


def test_limits_come_from_the_config(compose):
    from stepflow.serve_reward import Limits, limits_from_config

    cfg = compose("serve_reward", ["reward=shapes_geneval", "max_image_pixels=4096", "max_images=3"])
    lim = limits_from_config(cfg)
    assert lim.max_image_pixels == 4096 and lim.max_images == 3
    cfg = compose("serve_reward", ["reward=shapes_geneval"])
    assert limits_from_config(cfg) == Limits()  # the yaml and the dataclass defaults agree
    assert Limits().max_image_pixels < Image.MAX_IMAGE_PIXELS  # our check comes before PIL's


# ---------------------------------------------------------------- load


def test_load_valid_and_malformed_from_threads():
    """8 threads x 10 requests, valid and malformed interleaved: every valid request gets its exact scores, every
    malformed one a one-line 4xx, the whole run stays within tens of seconds."""
    bad = ["content_length_abc", "empty_batch", "not_json", "image_not_base64", "too_many_pixels",
           "content_length_missing", "meta_item_not_object", "image_truncated", "too_many_images", "chunked"]
    errors: list[str] = []
    counts = {"valid": 0, "malformed": 0}
    lock = threading.Lock()

    def worker(k: int, port: int) -> None:
        for j in range(10):
            try:
                if (k + j) % 2 == 0:
                    req, expected = valid(1 + (k + j) % 3, seed=100 * k + j)
                    status, reply, _ = post(port, req)
                    ok = status == 200 and reply["scores"] == pytest.approx(expected, abs=1e-6)
                    kind = "valid"
                else:
                    name = bad[(k * 3 + j) % len(bad)]
                    item, code = MALFORMED[name]
                    status, reply, _ = raw_request(port, _raw(item), timeout=30)
                    ok = status == code and isinstance(reply, dict) and "\n" not in reply.get("error", "\n")
                    kind = "malformed"
                with lock:
                    counts[kind] += 1
                    if not ok:
                        errors.append(f"thread {k} request {j} ({kind}): {status} {str(reply)[:120]}")
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(f"thread {k} request {j}: {type(e).__name__}: {e}")

    t0 = time.monotonic()
    with Server(MeanReward(), **LIMITS) as srv:
        threads = [threading.Thread(target=worker, args=(k, srv.port)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads)
        status, reply, _ = raw_request(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
    assert errors == []
    assert counts == {"valid": 40, "malformed": 40}
    assert time.monotonic() - t0 < 60


# ---------------------------------------------------------------- start-up: limits, port, host


def _one_line(e: BaseException, needle: str) -> str:
    msg = str(e)
    assert "\n" not in msg and needle in msg, msg
    return msg


#: (field, value) pairs that would refuse every request or drop every connection, or are no number at all
BAD_LIMITS = [("max_images", -1), ("max_images", 0), ("max_images", 2.5), ("max_images", True), ("max_images", "8"),
              ("max_body_mb", -1), ("max_body_mb", 0), ("max_body_mb", math.inf), ("max_body_mb", math.nan),
              ("max_image_pixels", 0), ("max_request_pixels", -5), ("decode_workers", 0), ("max_inflight", 0),
              ("max_inflight", -1), ("read_timeout_s", -1), ("read_timeout_s", 0), ("read_timeout_s", math.inf),
              ("read_timeout_s", math.nan)]


@pytest.mark.parametrize("field,value", BAD_LIMITS)
def test_a_limit_that_refuses_everything_is_one_line_naming_it(field, value):
    from stepflow.serve_reward import Limits, check_limit, make_server

    with pytest.raises(StepflowError) as ei:
        check_limit(field, value)
    msg = _one_line(ei.value, f"{field}: must be ")
    assert f"got {value!r}" in msg and f"; give {field}=" in msg
    with pytest.raises(StepflowError, match=f"^{field}: must be "):
        Limits(**{field: value})
    reward = MeanReward()
    with pytest.raises(StepflowError, match=f"^{field}: must be "):  # before anything is bound or served
        make_server(reward, "127.0.0.1", 0, **{field: value})
    assert reward.seen == []


def test_limits_from_the_config_are_checked(compose):
    from stepflow.serve_reward import Limits, limits_from_config

    cfg = compose("serve_reward", ["reward=shapes_geneval", "max_image_pixels=-1"])
    with pytest.raises(StepflowError, match=r"^max_image_pixels: must be an integer >= 1, got -1; "):
        limits_from_config(cfg)
    cfg = compose("serve_reward", ["reward=shapes_geneval", "max_images=4.0", "read_timeout_s=2"])
    assert limits_from_config(cfg) == Limits(max_images=4, read_timeout_s=2.0)  # integral values are accepted


@pytest.mark.parametrize("port", [99999, -1, 65536, "abc", 1.5, True, None])
def test_a_port_outside_0_65535_is_one_line(port):
    from stepflow.serve_reward import check_bind, make_server

    with pytest.raises(StepflowError) as ei:
        make_server(MeanReward(), "127.0.0.1", port)
    _one_line(ei.value, "port: must be an integer in 0..65535")
    with pytest.raises(StepflowError, match="^port: "):
        check_bind("127.0.0.1", port)


def test_a_port_in_use_is_one_line_naming_the_port():
    from stepflow.serve_reward import check_bind, make_server

    with Server(MeanReward()) as srv:
        with pytest.raises(StepflowError) as ei:
            make_server(MeanReward(), "127.0.0.1", srv.port)
        msg = _one_line(ei.value, f"port: port {srv.port} is in use")
        assert "port=0" in msg
        with pytest.raises(StepflowError, match=f"^port: port {srv.port} is in use"):
            check_bind("127.0.0.1", srv.port)  # the early check of the entry point, before the reward is built
        req, expected = valid(1)  # the server that holds the port is not disturbed
        status, reply, _ = post(srv.port, req)
        assert status == 200 and reply["scores"] == pytest.approx(expected)


@pytest.mark.parametrize("host,needle", [("nosuchhost.invalid", "host: cannot resolve 'nosuchhost.invalid'"),
                                         ("192.0.2.1", "host: 192.0.2.1 is not an address of this machine"),
                                         ("", "host: must be a host name"), (None, "host: must be a host name")])
def test_a_host_that_cannot_be_bound_is_one_line(host, needle):
    from stepflow.serve_reward import check_bind, make_server

    with pytest.raises(StepflowError) as ei:
        make_server(MeanReward(), host, 0)
    assert "host=127.0.0.1" in _one_line(ei.value, needle)
    with pytest.raises(StepflowError, match=f"^{needle}"):
        check_bind(host, 0)




@pytest.mark.parametrize("args,needle", [
    (["max_images=-1"], "max_images: must be an integer >= 1, got -1"),
    # checked before the reward is built: its own error (mode) would come first otherwise
    (["read_timeout_s=-1", "reward.mode=bogus"], "read_timeout_s: must be a finite number > 0, got -1"),
])
def test_serve_reward_cli_refuses_a_bad_limit_at_start(tmp_path, args, needle):
    r = run_cli("stepflow.serve_reward", "reward=shapes_geneval", *args, "port=0", f"hydra.run.dir={tmp_path}",
                timeout=300)  # seconds when idle (a loaded CPU: minutes); a server that starts anyway serves until it
    _cli_error(r, needle)


# ---------------------------------------------------------------- metadata the reward cannot use


class KeyedReward(MeanReward):
    """Reads meta[i]["k"]: a request without it is the client's fault (KeyError)."""

    def score(self, images, prompts, meta):
        ks = [float(m["k"]) for m in meta]
        return RewardOut(super().score(images, prompts, meta).scores + torch.tensor(ks))


@pytest.mark.parametrize("reward,meta,needle", [
    ("shapes", [{"tag": "single_object", "include": "a circle"}], "ValueError"),
    ("shapes", [{"tag": "single_object", "include": [{"class": "hexagon", "count": 1}]}], "hexagon"),
    ("shapes", [{"include": [{"class": "circle", "count": 1}]}], "without a 'tag'"),
    ("keyed", [{"j": 1}], "KeyError: 'k'"),
    ("keyed", [None], "TypeError"),
])
def test_metadata_the_reward_cannot_use_is_a_422(reward, meta, needle):
    from stepflow.rewards.shapes_geneval import ShapesGenEvalReward

    rew = ShapesGenEvalReward() if reward == "shapes" else KeyedReward()
    with Server(rew) as srv:
        status, reply, dt = post(srv.port, {"images": [_A8], "prompts": ["a circle"], "meta": meta})
        assert_one_line_error(status, reply, 422, 422, needle)
        assert "the reward cannot score this request" in reply["error"] and dt < FEW_S
        good = [{"tag": "single_object", "include": [{"class": "circle", "count": 1}]}] if reward == "shapes" \
            else [{"k": 1}]
        status, reply, _ = post(srv.port, {"images": [_A8], "prompts": ["a circle"], "meta": good})
        assert status == 200 and len(reply["scores"]) == 1  # and the server goes on serving


def test_a_reward_fault_is_still_a_500():
    """What the reward raises for other reasons (RuntimeError: a model that fell over, out of memory), and scores
    of the wrong shape, are the server's fault: 500, which clients retry."""

    class Fails(MeanReward):
        def score(self, images, prompts, meta):
            raise RuntimeError("CUDA error: device-side assert")

    class WrongShape(MeanReward):
        def score(self, images, prompts, meta):
            return RewardOut(torch.zeros(len(prompts) + 1))

    for reward, needle in ((Fails(), "RuntimeError: CUDA error"), (WrongShape(), "scores of shape (2,)")):
        with Server(reward) as srv:
            req, _ = valid(1)
            status, reply, _ = post(srv.port, req)
            assert_one_line_error(status, reply, 500, 500, needle)
