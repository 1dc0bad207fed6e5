"""HTTP rewards against local servers on 127.0.0.1 in threads: the ``remote`` client (success, timeout -> retries ->
RewardServiceError, retry-then-success, malformed replies, 4xx), ``unifiedreward`` against a fake OpenAI-compatible
endpoint, and a ``stepflow.serve_reward`` round trip (client scores == local scores). Settings that cannot work (a
malformed ``reward.url``, a timeout of 0, negative retries, ...) are one line naming ``reward.<field>`` when the reward
is built, bad metadata is refused before anything is sent, and a 4xx (the server's 422 for metadata its reward
cannot use) is not retried."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from stepflow.errors import MalformedReplyError, RewardServiceError
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import to_uint8
from stepflow.testing.harness import FakeHTTPServer


class FakeServer(FakeHTTPServer):
    """The shared fake server speaking JSON: ``behave(n, path, headers, body) -> (status, obj_or_bytes, delay_s)``;
    ``calls[i]["body"]``: the request's JSON."""

    def __init__(self, behave):
        def handler(n, path, headers, data):
            self.calls[n]["body"] = json.loads(data)
            return behave(n, path, headers, self.calls[n]["body"])

        super().__init__(handler)


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _mean_reply(n, path, headers, body):
    """A well-behaved server: score = mean pixel of each image / 255, component = the prompt length."""
    scores = [float(_decode(s).mean() / 255) for s in body["images"]]
    return 200, {"scores": scores, "components": {"len": [float(len(p)) for p in body["prompts"]]}}, 0.0


def _images(b=5, seed=0):
    return torch.rand(b, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _client(url, **kw):
    from stepflow.rewards.remote import RemoteReward

    r = RemoteReward(url=url, **{"timeout_s": 5, "max_retries": 2, "backoff_s": 0.01, **kw})
    r.sleeps = []
    r._sleep = r.sleeps.append  # record the backoff schedule instead of sleeping
    return r


# ------------------------------------------------------------------ remote client


def test_remote_success_batches_and_meta():
    imgs, prompts = _images(5), ["a", "bb", "ccc", "dddd", "eeeee"]
    meta = [{"i": i, "t": torch.tensor([i, i])} for i in range(5)]  # tensors are sent as lists
    with FakeServer(_mean_reply) as srv:
        out = _client(srv.url, request_batch_size=2, concurrency=2)(imgs, prompts, meta)
    expected = torch.from_numpy(to_uint8(imgs).reshape(5, -1).mean(1) / 255).float()  # lossless PNG
    torch.testing.assert_close(out.scores, expected)
    torch.testing.assert_close(out.components["len"], torch.tensor([1.0, 2, 3, 4, 5]))
    assert len(srv.calls) == 3  # 2 + 2 + 1
    sent = sorted((c["body"]["prompts"], c["body"]["meta"]) for c in srv.calls)
    assert sent[0] == (["a", "bb"], [{"i": 0, "t": [0, 0]}, {"i": 1, "t": [1, 1]}])


def test_remote_timeout_retries_then_raises():
    with FakeServer(lambda *a: (200, {"scores": [0.0]}, 1.0)) as srv:
        r = _client(srv.url, timeout_s=0.2, max_retries=2, backoff_s=0.05)
        with pytest.raises(RewardServiceError) as ei:
            r(_images(1), ["x"])
    msg = str(ei.value)
    assert "\n" not in msg and "3 attempt" in msg and "timeout" in msg and srv.url in msg
    assert len(srv.calls) == 3
    assert r.sleeps == [0.05, 0.1]  # backoff_s * 2^k


def test_remote_retry_then_success():
    def flaky(n, *a):
        return (503, {"error": "warming up"}, 0.0) if n < 3 else _mean_reply(n, *a)

    with FakeServer(flaky) as srv:
        r = _client(srv.url, max_retries=5, backoff_s=0.5, max_backoff_s=1.8)
        out = r(_images(2), ["a", "b"])
    assert len(srv.calls) == 4 and out.scores.shape == (2,)
    assert r.sleeps == [0.5, 1.0, 1.8]  # 0.5 * 2^k, capped by max_backoff_s


def test_remote_connection_refused_is_retried():
    with FakeServer(_mean_reply) as srv:
        url = srv.url
    r = _client(url, max_retries=1)
    with pytest.raises(RewardServiceError, match="connection failed"):
        r(_images(1), ["x"])
    assert r.sleeps == [0.01]


@pytest.mark.parametrize("reply,needle", [
    ({"score": [1.0]}, "'scores'"),                          # wrong key
    ({"scores": [1.0, 2.0]}, "'scores' is a list of 2"),     # wrong length
    ({"scores": ["high"]}, "'scores'"),                      # not numbers
    ({"scores": [1.0], "components": {"c": [1, 2]}}, "components.c"),
    (b"<html>oops</html>", "non-JSON"),
])
def test_remote_malformed_reply_is_a_clear_error(reply, needle):
    with FakeServer(lambda *a: (200, reply, 0.0)) as srv:
        with pytest.raises(MalformedReplyError) as ei:
            _client(srv.url)(_images(1), ["x"])
    msg = str(ei.value)
    assert needle in msg and "expected" in msg and "\n" not in msg
    assert len(srv.calls) == 1  # not retried


def test_remote_client_error_is_not_retried():
    with FakeServer(lambda *a: (400, {"error": "prompts must be strings"}, 0.0)) as srv:
        with pytest.raises(RewardServiceError, match="HTTP 400: prompts must be strings"):
            _client(srv.url)(_images(1), ["x"])
    assert len(srv.calls) == 1


# ------------------------------------------------------------------ unifiedreward


def _chat_reply(text):
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                           "content": text}}]}


def _unified(url, **kw):
    from stepflow.rewards.unifiedreward import UnifiedReward

    r = UnifiedReward(base_url=url, **{"image_size": 16, "timeout_s": 5, "max_retries": 2, "backoff_s": 0.01,
                                       "concurrency": 3, **kw})
    r._sleep = lambda s: None
    return r


def test_unifiedreward_request_and_score():
    from stepflow.rewards.unifiedreward import PAPER_PROMPT

    def judge(n, path, headers, body):
        caption = body["messages"][0]["content"][1]["text"].rsplit("[", 1)[1].rstrip("]")
        return 200, _chat_reply(f"The image is fine.\nFinal Score: {len(caption)}"), 0.0

    prompts = ["a", "abc", "abcde", "abcd"]
    with FakeServer(judge) as srv:
        out = _unified(srv.url + "/v1")(_images(4, seed=3), prompts)  # a base_url ending in /v1 is accepted
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 3, 5, 4]) / 5)  # Final Score / 5
    torch.testing.assert_close(out.components["raw"], torch.tensor([1.0, 3, 5, 4]))
    captions = sorted(c["body"]["messages"][0]["content"][1]["text"].rsplit("Text Caption: ", 1)[1] for c in srv.calls)
    assert captions == sorted(f"[{p}]" for p in prompts)  # one request per image, caption in brackets
    call = srv.calls[0]
    assert call["path"] == "/v1/chat/completions"
    assert call["headers"]["Authorization"] == "Bearer flowgrpo"
    body = call["body"]
    assert body["model"] == "UnifiedReward-7b-v1.5" and body["temperature"] == 0.0
    img, txt = body["messages"][0]["content"]
    assert img["type"] == "image_url" and img["image_url"]["url"].startswith("data:image/png;base64,")
    assert _decode(img["image_url"]["url"].split(",", 1)[1]).shape == (16, 16, 3)
    assert txt["type"] == "text" and txt["text"].startswith("<image>\n" + PAPER_PROMPT)
    assert "Final Score:" in PAPER_PROMPT and "1 to 5" in PAPER_PROMPT


def test_unifiedreward_failures():
    with FakeServer(lambda *a: (200, {"choices": []}, 0.0)) as srv:
        with pytest.raises(MalformedReplyError, match="choices"):
            _unified(srv.url)(_images(1), ["x"])
    with FakeServer(lambda *a: (200, _chat_reply("I like it a lot."), 0.0)) as srv:
        with pytest.raises(MalformedReplyError, match="Final Score"):
            _unified(srv.url)(_images(1), ["x"])
        assert _unified(srv.url, on_missing_score="zero")(_images(1), ["x"]).scores.item() == 0.0
    with FakeServer(lambda n, *a: (500, {}, 0.0) if n == 0 else (200, _chat_reply("**Final Score:** 3.5"), 0.0)) as s:
        assert _unified(s.url)(_images(1), ["x"]).scores.item() == pytest.approx(0.7)  # retried once
    with FakeServer(lambda *a: (502, {}, 0.0)) as srv:
        with pytest.raises(RewardServiceError, match="3 attempt"):
            _unified(srv.url)(_images(1), ["x"])


def test_parse_final_score():
    from stepflow.rewards.unifiedreward import parse_final_score

    assert parse_final_score("blah\nFinal Score: 4") == 4.0
    assert parse_final_score("Final Score:3.25 because") == 3.25
    assert parse_final_score("**Final Score**: 2") == 2.0
    assert parse_final_score("Score: 4") is None


# ------------------------------------------------------------------ serve_reward round trip


class QuantizedMean(Reward):
    """A tiny deterministic reward with a component (what it sees is uint8-rounded, like every real reward)."""

    name = "qmean"
    batch_size = 3

    def score(self, images, prompts, meta):
        u8 = torch.from_numpy(to_uint8(images)).float()
        s = u8.mean(dim=(1, 2, 3)) / 255 + torch.tensor([len(p) for p in prompts]) * 0.01
        extra = torch.tensor([float(m["k"]) if m else -1.0 for m in (meta or [None] * len(prompts))])
        return RewardOut(s, {"red": u8[..., 0].mean(dim=(1, 2)) / 255, "meta_k": extra})


class Boom(Reward):
    name = "boom"

    def score(self, images, prompts, meta):
        raise RuntimeError("model fell over")


def _serve(reward):
    from stepflow.serve_reward import make_server

    srv = make_server(reward, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_serve_reward_round_trip():
    import urllib.request

    local = QuantizedMean()
    srv, url = _serve(local)
    try:
        imgs, prompts = _images(7, seed=4), [f"p{'x' * i}" for i in range(7)]
        meta = [{"k": i} for i in range(7)]
        remote = _client(url, request_batch_size=4)(imgs, prompts, meta)
        mine = local(imgs, prompts, meta)
        torch.testing.assert_close(remote.scores, mine.scores)
        assert set(remote.components) == {"red", "meta_k"}
        for k in mine.components:
            torch.testing.assert_close(remote.components[k], mine.components[k])
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"status": "ok", "reward": "qmean"}
        # a bad request is a 400 with a one-line reason (not retried)
        from stepflow.rewards.remote import post_json

        with pytest.raises(RewardServiceError, match="HTTP 400: 2 images but 1 prompts"):
            post_json(url, {"images": ["", ""], "prompts": ["a"]}, timeout_s=5, max_retries=3, backoff_s=0)
    finally:
        srv.shutdown()
        srv.server_close()


def test_serve_reward_failure_is_a_500():
    srv, url = _serve(Boom())
    try:
        r = _client(url, max_retries=1)
        with pytest.raises(RewardServiceError, match="HTTP 500: RuntimeError: model fell over"):
            r(_images(1), ["x"])
    finally:
        srv.shutdown()
        srv.server_close()


def test_serve_reward_config_composes(compose):
    """conf/serve_reward.yaml + a reward group option builds; the reward option is mandatory."""
    from hydra.errors import ConfigCompositionException

    from stepflow.rewards.ocr import OCRReward
    from stepflow.rewards.registry import build_reward

    cfg = compose("serve_reward", ["reward=ocr", "reward.engine=builtins:str", "port=0"])
    with pytest.raises(ConfigCompositionException, match="You must specify 'reward'"):
        compose("serve_reward")
    assert cfg.host == "127.0.0.1" and cfg.port == 0
    assert isinstance(build_reward(cfg.reward), OCRReward)
    g = compose("serve_reward", ["reward=geneval_server"]).reward
    assert g.url == "http://127.0.0.1:18085" and g._target_ == "stepflow.rewards.remote.RemoteReward"


# ------------------------------------------------------------------ interruptible waits, progress, non-finite scores


@pytest.fixture
def stop_flag():
    """stepflow.core.stop cleared before and after; ``later(s)`` requests a stop ``s`` seconds from now."""
    from stepflow.core import stop

    stop.clear()
    timers = []

    def later(seconds: float):
        t = threading.Timer(seconds, stop.request, args=("SIGTERM (test)",))
        t.start()
        timers.append(t)

    yield later
    for t in timers:
        t.cancel()
    stop.clear()


def _stoppable(url, **kw):
    """A client with the real (interruptible) back-off."""
    from stepflow.rewards.remote import RemoteReward

    return RemoteReward(url=url, **{"timeout_s": 30, "max_retries": 0, "backoff_s": 0.01, **kw})


def test_remote_stop_interrupts_a_hanging_request(stop_flag):
    """The server takes 6 s; a stop requested after 0.3 s raises StopRequested within about a second."""
    from stepflow.errors import StopRequested

    with FakeServer(lambda *a: (200, {"scores": [0.5]}, 6.0)) as srv:
        stop_flag(0.3)
        t0 = time.monotonic()
        with pytest.raises(StopRequested, match="SIGTERM"):
            _stoppable(srv.url)(_images(1), ["x"])
        assert time.monotonic() - t0 < 3.0


def test_remote_stop_interrupts_the_backoff(stop_flag):
    """A 503 then a 5 s back-off: the stop (after 0.3 s) ends the wait, no second attempt is made."""
    from stepflow.errors import StopRequested

    with FakeServer(lambda *a: (503, {"error": "warming up"}, 0.0)) as srv:
        stop_flag(0.3)
        t0 = time.monotonic()
        with pytest.raises(StopRequested):
            _stoppable(srv.url, max_retries=3, backoff_s=5.0)(_images(1), ["x"])
        assert time.monotonic() - t0 < 3.0
        assert len(srv.calls) == 1


def test_remote_stop_already_requested_sends_nothing(stop_flag):
    from stepflow.core import stop
    from stepflow.errors import StopRequested

    stop.request("test")
    with FakeServer(_mean_reply) as srv:
        with pytest.raises(StopRequested):
            _stoppable(srv.url)(_images(2), ["a", "b"])
        assert srv.calls == []


def test_remote_slow_request_logs_progress(caplog):
    """A request still waiting logs 'waiting N s for <url> (batch B, ...)' every progress_every_s, before any
    timeout, and the reply still arrives."""
    with FakeServer(lambda n, p, h, body: (200, {"scores": [0.25] * len(body["prompts"])}, 1.4)) as srv:
        with caplog.at_level("WARNING", logger="stepflow.rewards.remote"):
            out = _client(srv.url, timeout_s=30, progress_every_s=0.4)(_images(2), ["a", "b"])
    assert out.scores.tolist() == [0.25, 0.25]
    lines = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert 2 <= len(lines) <= 4, lines
    assert srv.url in lines[0] and "batch 2" in lines[0] and "timeout 30 s" in lines[0]


def test_remote_timeout_is_a_total_bound():
    """A server that trickles its reply (a byte every 0.1 s, never idle for timeout_s) still times out after
    timeout_s in total, not after the whole trickle."""
    import socketserver

    class Trickle(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            reply = json.dumps({"scores": [0.5]}).encode()
            try:
                self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: %d\r\n\r\n" % len(reply))
                for b in reply + b" " * 40:
                    self.request.sendall(bytes([b]))
                    time.sleep(0.1)
            except OSError:
                pass

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Trickle)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    try:
        r = _client(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.6, max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(RewardServiceError, match="timeout after 0.6s"):
            r(_images(1), ["x"])
        assert time.monotonic() - t0 < 1.8  # the trickle would take > 1.5 s
    finally:
        srv.shutdown()
        srv.server_close()


def test_remote_non_finite_scores_are_kept_counted_and_warned_once(caplog):
    """NaN / Infinity (Python's JSON) and null (strict JSON servers) are read as non-finite scores: kept in place,
    counted over the whole call (two requests here) and named in one warning."""
    replies = {0: [float("nan"), 0.5, None], 1: [float("inf"), 0.25]}

    def behave(n, path, headers, body):
        first = body["prompts"][0] == "a"
        return 200, {"scores": replies[0 if first else 1]}, 0.0

    with FakeServer(behave) as srv:
        with caplog.at_level("WARNING", logger="stepflow.rewards.remote"):
            out = _client(srv.url, request_batch_size=3)(_images(5), ["a", "b", "c", "d", "e"])
    s = out.scores
    assert torch.isnan(s[0]) and s[1] == 0.5 and torch.isnan(s[2]) and torch.isinf(s[3]) and s[4] == 0.25
    warned = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(warned) == 1 and "3 of 5 scores" in warned[0] and srv.url in warned[0]


def test_remote_failure_does_not_wait_for_other_requests():
    """With requests in flight in parallel, the first refusal (HTTP 400) is raised at once; the slow request in
    flight is given up instead of waited for."""
    def behave(n, path, headers, body):
        if body["prompts"][0] == "slow":
            return 200, {"scores": [0.5]}, 5.0
        return 400, {"error": "bad prompt"}, 0.2

    with FakeServer(behave) as srv:
        t0 = time.monotonic()
        with pytest.raises(RewardServiceError, match="bad prompt"):
            _client(srv.url, request_batch_size=1, concurrency=2, timeout_s=30)(_images(2), ["slow", "bad"])
        assert time.monotonic() - t0 < 3.0


def test_unifiedreward_stop_and_progress(stop_flag, caplog):
    """The chat client: progress 'k/n images done' while a judge call is slow, and a stop interrupts it."""
    from stepflow.errors import StopRequested

    def judge(n, path, headers, body):
        caption = body["messages"][0]["content"][1]["text"].rsplit("[", 1)[1].rstrip("]")
        return 200, _chat_reply("Final Score: 4"), (1.4 if caption == "slow" else 0.0)

    with FakeServer(judge) as srv:
        with caplog.at_level("WARNING", logger="stepflow.rewards.remote"):
            out = _unified(srv.url, progress_every_s=0.4)(_images(3), ["a", "slow", "b"])
        assert out.scores.tolist() == pytest.approx([0.8] * 3)
        lines = [r.getMessage() for r in caplog.records if "images done" in r.getMessage()]
        assert lines and "2/3 images done" in lines[0] and srv.url in lines[0]

    with FakeServer(lambda *a: (200, _chat_reply("Final Score: 4"), 6.0)) as srv:
        stop_flag(0.3)
        t0 = time.monotonic()
        with pytest.raises(StopRequested):
            _unified(srv.url, timeout_s=30)(_images(4), ["a", "b", "c", "d"])
        assert time.monotonic() - t0 < 3.0


def test_unifiedreward_backoff_is_interruptible(stop_flag):
    from stepflow.errors import StopRequested
    from stepflow.rewards.unifiedreward import UnifiedReward

    with FakeServer(lambda *a: (502, {}, 0.0)) as srv:
        r = UnifiedReward(base_url=srv.url, image_size=16, timeout_s=30, max_retries=3, backoff_s=5.0)
        stop_flag(0.3)
        t0 = time.monotonic()
        with pytest.raises(StopRequested):
            r(_images(1), ["x"])
        assert time.monotonic() - t0 < 3.0 and len(srv.calls) == 1


# ------------------------------------------------------------------ settings, metadata, 4xx


@pytest.mark.parametrize("url,needle", [
    ("notaurl", "has no http:// or https:// scheme"),
    ("127.0.0.1:18085", "has no http:// or https:// scheme"),
    ("localhost:18085", "has no http:// or https:// scheme"),
    ("ftp://127.0.0.1:18085", "has the scheme 'ftp'"),
    ("http://", "names no host"),
    ("http:///score", "names no host"),
    ("http://127.0.0.1:99999", "bad port"),
    ("http://127.0.0.1:abc", "bad port"),
    ("http://127.0.0.1:0", "port 0"),
    ("http://127.0.0.1:18085/a b", "spaces"),
    ("", "must be an http(s) URL"),
    (None, "must be an http(s) URL"),
])
def test_remote_malformed_url_is_one_line_when_built(url, needle, capsys):
    from stepflow.cli import report
    from stepflow.errors import StepflowError
    from stepflow.rewards.registry import build_reward

    with pytest.raises(StepflowError) as ei:
        _client(url)
    msg = str(ei.value)
    assert msg.startswith("reward.url: ") and needle in msg and "\n" not in msg
    assert "reward.url=http://127.0.0.1:18085" in msg  # the fix
    with pytest.raises(StepflowError) as ei:  # through Hydra's instantiate, as train / evaluate build it
        build_reward({"_target_": "stepflow.rewards.remote.RemoteReward", "url": url})
    assert str(ei.value) == msg
    with pytest.raises(SystemExit) as ex:
        report(ei.value)
    assert ex.value.code != 0 and capsys.readouterr().err == f"stepflow: error: {msg}\n"


@pytest.mark.parametrize("url", ["http://127.0.0.1:18085", "https://reward.example.org/score?x=1",
                                 "http://[::1]:8080", "HTTP://host"])
def test_remote_good_urls_are_accepted(url):
    assert _client(url).url == url


@pytest.mark.parametrize("field,value", [
    ("timeout_s", 0), ("timeout_s", -1), ("timeout_s", float("inf")), ("timeout_s", float("nan")),
    ("max_retries", -1), ("max_retries", 1.5), ("max_retries", "3"), ("request_batch_size", 0),
    ("request_batch_size", True), ("concurrency", 0), ("backoff_s", -0.5), ("max_backoff_s", float("nan")),
    ("progress_every_s", -1), ("max_reply_mb", 0), ("jpeg_quality", 0), ("jpeg_quality", 101),
    ("headers", "Bearer x"), ("headers", {"Authorization": "a\r\nX-Evil: 1"}), ("headers", {"Bad Name": "x"}),
])
def test_remote_bad_setting_is_one_line_naming_it(field, value):
    from stepflow.errors import StepflowError
    from stepflow.rewards.registry import build_reward

    with pytest.raises(StepflowError) as ei:
        _client("http://127.0.0.1:9", **{field: value})
    msg = str(ei.value)
    assert msg.startswith(f"reward.{field}") and "\n" not in msg and f"; give reward.{field}=" in msg, msg
    with pytest.raises(StepflowError, match=f"^reward.{field}"):
        build_reward({"_target_": "stepflow.rewards.remote.RemoteReward", "url": "http://127.0.0.1:9", field: value})


def test_remote_settings_keep_their_meaning():
    r = _client("http://127.0.0.1:9", max_retries=0, backoff_s=0, progress_every_s=None, request_batch_size=8.0,
                headers={"X-Token": 7})
    assert (r.max_retries, r.backoff_s, r.progress_every_s, r.request_batch_size) == (0, 0.0, 0.0, 8)
    assert r.headers == {"X-Token": "7"}


@pytest.mark.parametrize("meta,needle", [([{"k": 1}], "3 prompts but 1 meta records"),
                                         ([{"k": 1}, 7, None], r"meta\[1\] is a int")])
def test_remote_bad_meta_is_refused_before_sending(meta, needle):
    with FakeServer(_mean_reply) as srv:
        with pytest.raises(ValueError, match=needle):
            _client(srv.url)(_images(3), ["a", "b", "c"], meta)
    assert srv.calls == []


@pytest.mark.parametrize("meta,needle", [([{"j": 1}, {"k": 2}], "HTTP 422: the reward cannot score this request "
                                                                "(KeyError: 'k')"),
                                         ([{"k": "high"}, {"k": 2}], "HTTP 422: the reward cannot score this "
                                                                     "request (ValueError: could not convert")])
def test_metadata_the_server_reward_cannot_use_is_not_retried(meta, needle):
    """serve_reward answers 422 for metadata its reward cannot use; the client raises at once with that line."""
    srv, url = _serve(QuantizedMean())
    try:
        r = _client(url, max_retries=3)
        with pytest.raises(RewardServiceError) as ei:
            r(_images(2), ["a", "b"], meta)
        msg = str(ei.value)
        assert needle in msg and "was refused" in msg and "\n" not in msg
        assert r.sleeps == []  # no retry
        assert r(_images(2), ["a", "b"], [{"k": 1}, {"k": 2}]).scores.shape == (2,)  # the server goes on serving
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("code", [400, 404, 413, 422])
def test_remote_4xx_is_not_retried(code):
    with FakeServer(lambda *a: (code, {"error": f"refused with {code}"}, 0.0)) as srv:
        r = _client(srv.url, max_retries=4)
        with pytest.raises(RewardServiceError, match=f"HTTP {code}: refused with {code}"):
            r(_images(1), ["x"])
    assert len(srv.calls) == 1 and r.sleeps == []
