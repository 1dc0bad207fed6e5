"""UnifiedReward (a VLM judge, ``CodeGoat24/UnifiedReward-7b-v1.5``) through an OpenAI-compatible chat endpoint.

Serve the model with SGLang or vLLM, e.g.::

    python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5 --port 17140 --api-key flowgrpo
    vllm serve CodeGoat24/UnifiedReward-7b-v1.5 --port 17140 --api-key flowgrpo

Each image is sent on its own: POST ``{base_url}/v1/chat/completions`` with one user message holding the image
(``data:image/png;base64,...``, resized to ``image_size`` square as Flow-GRPO) and the paper's prompt (appendix E.3)
followed by the caption; temperature 0. The reply's ``Final Score: X`` (1-5) gives ``score = X / 5``, as
Flow-GRPO. Requests run ``concurrency`` at a time (threads) with the retry/backoff policy of
:mod:`stepflow.rewards.remote`; exhausted retries raise ``RewardServiceError``. A reply without ``choices[0].message
.content`` raises ``MalformedReplyError``; a reply without a parsable score does too unless
``on_missing_score: zero`` (Flow-GRPO's behaviour: score 0).

Waits are interruptible as in :mod:`stepflow.rewards.remote`: a stop request (:mod:`stepflow.core.stop`, set by the
training run's SIGTERM handler) raises ``StopRequested`` within a fraction of a second, during a request or a
back-off; while requests are outstanding a warning every ``progress_every_s`` seconds says how many images are
scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from stepflow.errors import MalformedReplyError, one_line
from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.loading import to_pil
from stepflow.rewards.remote import backoff_wait, map_interruptible, png_b64, post_json

#: the paper's UnifiedReward instruction (appendix E.3; straight quotes); PROMPT_TEMPLATE appends the caption
PAPER_PROMPT = (
    "You are given a text caption and a generated image based on that caption. Your task is to evaluate this image "
    "based on two key criteria: (1) Alignment with the Caption: Assess how well this image aligns with the provided "
    "caption. Consider the accuracy of depicted objects, their relationships, and attributes. (2) Overall Image "
    "Quality: Examine the visual quality including clarity, detail preservation, color accuracy, and aesthetic "
    "appeal. Assign a score from 1 to 5 after 'Final Score:'."
)
#: how the caption is given to the judge (Flow-GRPO's layout: instruction, then "Text Caption: [...]")
PROMPT_TEMPLATE = "<image>\n" + PAPER_PROMPT + "\nYour task is provided as follows:\nText Caption: [{prompt}]"

SCORE_RE = re.compile(r"Final Score\s*\**\s*:?\s*\**\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


def parse_final_score(text: str) -> float | None:
    """The number after the last ``Final Score:`` (markdown bold tolerated); None when absent."""
    found = SCORE_RE.findall(text or "")
    return float(found[-1]) if found else None


class UnifiedReward(Reward):
    """base_url: the server root (``http://127.0.0.1:17140``; a trailing ``/v1`` is accepted); model: the served
    model name; api_key: sent as ``Authorization: Bearer``; image_size: square resize before encoding (null: keep);
    score_max: the judge's top score (reward = X / score_max); timeout_s: the longest one attempt may take;
    progress_every_s: a progress warning every N seconds while requests are outstanding (0: off). Component:
    ``raw`` (X on the 1-5 scale)."""

    name = "unifiedreward"
    batch_size = 1 << 30  # all images reach score(); requests fan out there

    def __init__(self, base_url: str = "http://127.0.0.1:17140", model: str = "UnifiedReward-7b-v1.5",
                 api_key: str | None = "flowgrpo", prompt_template: str = PROMPT_TEMPLATE, image_size: int | None = 512,
                 score_max: float = 5.0, temperature: float = 0.0, max_tokens: int | None = None,
                 concurrency: int = 16, timeout_s: float = 120.0, max_retries: int = 5, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, on_missing_score: str = "error", progress_every_s: float = 10.0):
        if on_missing_score not in ("error", "zero"):
            raise ValueError(f"unifiedreward: on_missing_score must be 'error' or 'zero', got {on_missing_score!r}")
        if "{prompt}" not in prompt_template:
            raise ValueError("unifiedreward: prompt_template must contain '{prompt}'")
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.url = root + "/v1/chat/completions"
        self.model, self.prompt_template = model, prompt_template
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.image_size, self.score_max = image_size, float(score_max)
        self.temperature, self.max_tokens = float(temperature), max_tokens
        self.concurrency = max(1, int(concurrency))
        self.timeout_s, self.max_retries = float(timeout_s), int(max_retries)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.on_missing_score = on_missing_score
        self.progress_every_s = float(progress_every_s or 0)
        self._sleep: Callable[[float], None] = backoff_wait

    def request_body(self, image: Image.Image, prompt: str) -> dict[str, Any]:
        if self.image_size:
            image = image.resize((int(self.image_size), int(self.image_size)))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(image)}},
                {"type": "text", "text": self.prompt_template.format(prompt=prompt)},
            ]}],
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        return body

    def _one(self, image: Image.Image, prompt: str) -> float:
        data = post_json(self.url, self.request_body(image, prompt), timeout_s=self.timeout_s,
                         max_retries=self.max_retries, backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
                         headers=self.headers, what=f"reward {self.name}", sleep=self._sleep,
                         progress_every_s=0)  # score() logs the progress of all requests together
        try:
            text = data["choices"][0]["message"]["content"]
            if not isinstance(text, str):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise MalformedReplyError(
                f"reward {self.name}: reply from {self.url} is not a chat completion; expected "
                f'{{"choices": [{{"message": {{"content": "... Final Score: X"}}}}]}}, got {one_line(data, 120)}'
            ) from None
        x = parse_final_score(text)
        if x is None:
            if self.on_missing_score == "zero":
                return 0.0
            raise MalformedReplyError(f"reward {self.name}: reply from {self.url} has no 'Final Score: <1-5>' "
                                      f"(got {one_line(text, 120)!r}); set reward.on_missing_score=zero to score 0")
        return x

    def score(self, images: Tensor, prompts: Sequence[str], meta: Sequence[dict] | None) -> RewardOut:
        pil = to_pil(images)
        got = map_interruptible(self._one, list(zip(pil, prompts)), concurrency=self.concurrency,
                                what=f"reward {self.name}", url=self.url, unit="images",
                                progress_every_s=self.progress_every_s)
        raw = torch.tensor(got, dtype=torch.float32)
        return RewardOut(raw / self.score_max, {"raw": raw})
