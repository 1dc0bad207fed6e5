"""``RemoteReward(protocol="flow_grpo")`` against a local copy of Flow-GRPO's GenEval reward server on 127.0.0.1.

:class:`GenEvalApp` follows github ``yifan123/reward-server`` exactly where the protocol is concerned:
``app_geneval.py`` ``inference()`` (pickle.loads of the body; ``Image.open(BytesIO(d), formats=["jpeg"])`` for each
of ``data["images"]``; ``data["meta_datas"]``; ``data["only_strict"]``; a pickled dict of ``scores``, ``rewards``,
``strict_rewards``, ``group_rewards``, ``group_strict_rewards`` with 200, the traceback text with 500) and
``reward_server/gen_eval.py`` ``compute_geneval`` (the per-tag groups with -10.0 for the other tags). Only the
detector is fake: it reads the mean grey level of the image (0, 64, 128, 191, 255 -> partial credit 0 .. 1).
"""

from __future__ import annotations

import io
import pickle
import traceback
from collections import defaultdict
from io import BytesIO

import numpy as np
import pytest
import torch
from PIL import Image

from stepflow.errors import MalformedReplyError, RewardServiceError
from stepflow.testing.harness import FakeHTTPServer, Reply

LEVELS = [0, 64, 128, 191, 255]  # grey levels -> partial credit 0, .25, .5, .75, 1 (survives JPEG)
TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def fake_geneval(images, metadatas, only_strict=False):
    """``compute_geneval`` of reward_server/gen_eval.py with a fake ``evaluate_image``."""
    results = []
    for image, metadata in zip(images, metadatas):
        if metadata["tag"] == "boom":
            raise KeyError("boom")
        assert metadata["include"] is not None
        score = round(np.asarray(image.convert("RGB"), dtype=np.float64).mean() / 255 * 4) / 4
        is_correct = False if only_strict else score >= 0.5
        results.append({"tag": metadata["tag"], "prompt": metadata["prompt"], "correct": is_correct,
                        "strict_correct": score == 1.0, "score": score})
    # -- from here on as compute_geneval
    required_keys = ['single_object', 'two_object', 'counting', 'colors', 'position', 'color_attr']
    scores = []
    strict_rewards = []
    grouped_strict_rewards = defaultdict(list)
    rewards = []
    grouped_rewards = defaultdict(list)
    for result in results:
        strict_rewards.append(1.0 if result["strict_correct"] else 0.0)
        scores.append(result["score"])
        rewards.append(1.0 if result["correct"] else 0.0)
        tag = result["tag"]
        for key in required_keys:
            if key != tag:
                grouped_strict_rewards[key].append(-10.0)
                grouped_rewards[key].append(-10.0)
            else:
                grouped_strict_rewards[tag].append(1.0 if result["strict_correct"] else 0.0)
                grouped_rewards[tag].append(1.0 if result["correct"] else 0.0)
    return scores, rewards, strict_rewards, dict(grouped_rewards), dict(grouped_strict_rewards)


class GenEvalApp:
    """app_geneval.py's Flask route, on http.server: ``POST /`` -> (body, status). ``reply`` overrides the answer."""

    def __init__(self, inference_fn=fake_geneval, reply=None):
        self.inference_fn, self.reply = inference_fn, reply
        self.server = FakeHTTPServer(self._answer)
        self.requests = self.server.calls  # {"path", "headers", "data"} of every request
        self.url = self.server.url

    def _answer(self, n, path, headers, data):
        response, returncode = self.reply(data) if self.reply else self.inference(data)
        return Reply(returncode, response, "text/html; charset=utf-8")  # Flask's default for a bytes body

    def inference(self, data):
        # ---- app_geneval.py inference(), verbatim but for the print()s and Flask's request object
        try:
            data = pickle.loads(data)
            images = [Image.open(BytesIO(d), formats=["jpeg"]) for d in data["images"]]
            meta_datas = data["meta_datas"]
            only_strict = data["only_strict"]
            scores, rewards, strict_rewards, group_rewards, group_strict_rewards = self.inference_fn(
                images, meta_datas, only_strict)
            response = {"scores": scores, "rewards": rewards, "strict_rewards": strict_rewards,
                        "group_rewards": group_rewards, "group_strict_rewards": group_strict_rewards}
            response = pickle.dumps(response)
            returncode = 200
        except Exception:
            response = traceback.format_exc()
            response = response.encode("utf-8")
            returncode = 500
        return response, returncode

    def __enter__(self):
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()


def batch(n: int, tag_of=lambda i: TAGS[i % len(TAGS)]):
    """n solid grey 16x16 images, prompts, GenEval metadata (as a stepflow .jsonl gives it: no 'prompt' key, a
    tensor inside), and the partial credit the fake judge gives each."""
    levels = [LEVELS[i % len(LEVELS)] for i in range(n)]
    images = torch.stack([torch.full((3, 16, 16), v / 255.0) for v in levels])
    prompts = [f"a photo of {i} circles" for i in range(n)]
    meta = [{"tag": tag_of(i), "include": [{"class": "circle", "count": torch.tensor(1 + i % 3)}]} for i in range(n)]
    partial = [round(v / 255 * 4) / 4 for v in levels]
    return images, prompts, meta, partial


def client(url, **kw):
    from stepflow.rewards.remote import RemoteReward

    r = RemoteReward(url=url, **{"protocol": "flow_grpo", "name": "geneval", "timeout_s": 10, "max_retries": 2,
                                 "backoff_s": 0.01, **kw})
    r._sleep = lambda s: None
    return r


def test_flow_grpo_protocol_round_trip():
    """70 images -> 2 requests (64 + 6, Flow-GRPO's batch); JPEG bytes, GenEval meta with the prompt filled in,
    only_strict; reward = partial credit ('scores'), components partial and strict."""
    images, prompts, meta, partial = batch(70)
    with GenEvalApp() as app:
        out = client(app.url)(images, prompts, meta)
    torch.testing.assert_close(out.scores, torch.tensor(partial))
    assert set(out.components) == {"partial", "strict"}
    torch.testing.assert_close(out.components["strict"], torch.tensor([float(p == 1.0) for p in partial]))
    assert len(app.requests) == 2
    sent = [pickle.loads(r["data"]) for r in app.requests]
    assert sorted(len(s["images"]) for s in sent) == [6, 64]
    first = next(s for s in sent if len(s["images"]) == 64)
    assert set(first) == {"images", "meta_datas", "only_strict"} and first["only_strict"] is True
    assert all(isinstance(b, bytes) and b[:3] == b"\xff\xd8\xff" for b in first["images"])  # JPEG files
    assert Image.open(io.BytesIO(first["images"][0])).size == (16, 16)
    m = first["meta_datas"][1]
    assert m == {"tag": "two_object", "include": [{"class": "circle", "count": 2}], "prompt": prompts[1]}
    assert type(m["include"][0]["count"]) is int  # plain builtins, not tensors
    req = app.requests[0]
    assert req["path"] == "/" and req["headers"]["Content-Type"] == "application/octet-stream"


def test_strict_and_correct_scores():
    images, prompts, meta, partial = batch(10)
    with GenEvalApp() as app:
        strict = client(app.url, geneval_score="strict")(images, prompts, meta)
        correct = client(app.url, geneval_score="correct", only_strict=False)(images, prompts, meta)
    torch.testing.assert_close(strict.scores, torch.tensor([float(p == 1.0) for p in partial]))
    torch.testing.assert_close(correct.scores, torch.tensor([float(p >= 0.5) for p in partial]))
    assert set(correct.components) == {"partial", "strict", "correct"}
    assert [pickle.loads(r["data"])["only_strict"] for r in app.requests] == [True, False]
    with pytest.raises(ValueError, match="only_strict=false"):
        client("http://127.0.0.1:9", geneval_score="correct")
    with pytest.raises(ValueError, match="geneval_score"):
        client("http://127.0.0.1:9", geneval_score="lenient")


def test_unpickling_warning_is_printed_once(caplog):
    with caplog.at_level("WARNING", logger="stepflow.rewards.remote"):
        client("http://127.0.0.1:18999/once")
        client("http://127.0.0.1:18999/once")
    warned = [r.getMessage() for r in caplog.records if "unpickles" in r.getMessage()]
    assert len(warned) == 1 and "trust" in warned[0] and "http://127.0.0.1:18999/once" in warned[0]


def test_missing_geneval_metadata_is_a_clear_error_before_sending():
    images, prompts, meta, _ = batch(3)
    with GenEvalApp() as app:
        with pytest.raises(ValueError, match="protocol flow_grpo needs GenEval metadata"):
            client(app.url)(images, prompts, None)
        bad = [dict(m) for m in meta]
        del bad[2]["tag"]
        with pytest.raises(ValueError, match=r"meta\[2\]"):
            client(app.url)(images, prompts, bad)
        assert app.requests == []


def test_server_traceback_is_retried_then_named():
    """A 500 (the server's traceback) is retried; then one line naming the exception the server raised."""
    images, prompts, meta, _ = batch(2, tag_of=lambda i: "boom")
    with GenEvalApp() as app:
        with pytest.raises(RewardServiceError) as ei:
            client(app.url, max_retries=2)(images, prompts, meta)
    msg = str(ei.value)
    assert "\n" not in msg and "HTTP 500" in msg and "KeyError: 'boom'" in msg and "server traceback" in msg
    assert len(app.requests) == 3


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


def test_reply_pickle_with_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"scores": [_Evil(marker)], "rewards": [0.0], "strict_rewards": [0.0]})
    with GenEvalApp(reply=lambda data: (payload, 200)) as app:
        with pytest.raises(MalformedReplyError, match="refused to load"):
            client(app.url)(*batch(1)[:3])
    assert not marker.exists()


@pytest.mark.parametrize("reply,needle", [
    (pickle.dumps({"scores": [1.0]}), "not a GenEval reply"),
    (pickle.dumps({"scores": [1.0, 1.0], "rewards": [0.0], "strict_rewards": [0.0]}), "'scores' is a list of 2"),
    (pickle.dumps({"scores": ["x"], "rewards": [0.0], "strict_rewards": [0.0]}), "'scores'"),
    (pickle.dumps({"scores": [1.0], "rewards": [0.0], "strict_rewards": [0.0], "group_rewards": [1]}),
     "'group_rewards'"),
    (pickle.dumps([1.0]), "not a GenEval reply"),
    (b"<html>oops</html>", "not a pickle"),
], ids=["missing_keys", "wrong_length", "not_numbers", "group_not_dict", "not_a_dict", "not_a_pickle"])
def test_malformed_geneval_reply(reply, needle):
    with GenEvalApp(reply=lambda data: (reply, 200)) as app:
        with pytest.raises(MalformedReplyError) as ei:
            client(app.url)(*batch(1)[:3])
    assert needle in str(ei.value) and "\n" not in str(ei.value)
    assert len(app.requests) == 1  # not retried


def test_numpy_scores_and_non_finite_scores(caplog):
    """numpy scalars in the reply are accepted (a plain-data unpickler allows them); NaN is counted and warned."""
    def reply(data):
        n = len(pickle.loads(data)["images"])
        s = [np.float64("nan")] + [np.float32(0.5)] * (n - 1)
        return pickle.dumps({"scores": s, "rewards": [0.0] * n, "strict_rewards": [np.float64(1.0)] * n,
                             "group_rewards": {}, "group_strict_rewards": {}}), 200

    with GenEvalApp(reply=reply) as app:
        with caplog.at_level("WARNING", logger="stepflow.rewards.remote"):
            out = client(app.url)(*batch(3)[:3])
    assert torch.isnan(out.scores[0]) and out.scores[1:].tolist() == [0.5, 0.5]
    assert [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()][0].startswith(
        "reward geneval: 1 of 3 scores")


def test_geneval_server_config_selects_the_protocol():
    from stepflow.rewards.registry import build_reward, reward_config

    cfg = reward_config("geneval_server", ["protocol=flow_grpo", "geneval_score=strict"])
    r = build_reward(cfg)
    assert (r.protocol, r.geneval_score, r.only_strict, r.jpeg_quality) == ("flow_grpo", "strict", True, 75)
    assert r.url == "http://127.0.0.1:18085" and r.request_batch_size == 64 and r.name == "geneval"
    assert build_reward(reward_config("geneval_server")).protocol == "stepflow"  # stepflow's JSON stays the default
    with pytest.raises(Exception, match="protocol must be one of"):
        build_reward(reward_config("geneval_server", ["protocol=pickle"]))
