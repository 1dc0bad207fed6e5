"""Errors that reward models raise instead of deep tracebacks.

Both are one-line, actionable messages: the training loop catches :class:`RewardServiceError` to checkpoint and stop
cleanly, and a :class:`RewardLoadError` at start-up names the weights that are missing and the config key that
points at a local copy.
"""

from __future__ import annotations


class RewardError(RuntimeError):
    """Base class of stepflow reward errors."""


class RewardLoadError(RewardError):
    """Weights (or a tokenizer/processor/config) could not be loaded: offline, wrong path, wrong file."""


class RewardServiceError(RewardError):
    """A remote reward service failed: timeouts/5xx after all retries, a 4xx, or a reply we cannot use."""


class NonFiniteRewardsError(RewardServiceError):
    """Too many samples of an iteration scored NaN / inf (``loop.max_nonfinite_frac``): the run stops cleanly."""


class MalformedReplyError(RewardServiceError):
    """The service answered, but not with what the protocol expects (the message says what was expected)."""


def one_line(text: object, limit: int = 300) -> str:
    """Collapse an arbitrary message (often a multi-line library error) into one short line."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."
