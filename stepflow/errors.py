"""The errors stepflow raises, in one place: each is one actionable line (what, where, and the fix), not a traceback.

The bottom floor of the package (``stepflow/__init__.py``): this module imports nothing from stepflow, so every
module can raise and catch these without an import cycle.

- :class:`StepflowError` (a ``ValueError``): a user-facing configuration or input error; the entry points
  (``stepflow.cli``) print it as one line and exit with its ``exit_code``. :class:`ModelLoadError`,
  :class:`NonFiniteUpdate` and :class:`RemoteConfigError` are ones.
- :class:`RewardError` (a ``RuntimeError``) and its family: a reward that cannot load its weights
  (:class:`RewardLoadError`, at start-up, naming the weights and the config key of a local copy) or whose service
  failed (:class:`RewardServiceError`: the training loop checkpoints and stops cleanly).
- :class:`PromptFileError` (a ``ValueError``): a prompt file that is missing, empty or malformed.
- :class:`StopRequested`: a stop (SIGTERM / SIGINT) was asked for during a long wait (``stepflow.core.stop``).
"""

from __future__ import annotations

__all__ = ["StepflowError", "ModelLoadError", "NonFiniteUpdate", "PromptFileError", "RewardError", "RewardLoadError",
           "RewardServiceError", "NonFiniteRewardsError", "MalformedReplyError", "RemoteConfigError", "StopRequested",
           "one_line"]


def one_line(text: object, limit: int = 300) -> str:
    """Collapse an arbitrary message (often a multi-line library error) into one short line."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


# ---------------------------------------------------------------- settings and inputs


class StepflowError(ValueError):
    """A user-facing configuration or input error, printed as one line (``exit_code``: the process's status)."""

    exit_code = 2

    def __init__(self, msg: str = "", exit_code: int | None = None):
        super().__init__(msg)
        if exit_code is not None:
            self.exit_code = exit_code


class ModelLoadError(StepflowError):
    """A model could not be loaded. The message is one line: what, where from, and how to fix it.

    A ``ValueError`` (a :class:`StepflowError`): entry points print it as that one line, not a traceback.
    """


class NonFiniteUpdate(StepflowError):
    """The update's gradient is inf / nan: the run stops before the optimizer step writes it into the weights (under
    DeepSpeed, whose step is one call, right after it and before anything is saved)."""


class PromptFileError(ValueError):
    """A prompt file is missing, empty or malformed (one-line message naming the path)."""


# ---------------------------------------------------------------- rewards


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


class RemoteConfigError(StepflowError, RewardError):
    """A setting of the remote reward (``reward.<field>``) that cannot work, raised when the reward is built, before
    any request: one line naming the field and the fix. A :class:`StepflowError` (the entry points print it as is)
    and a :class:`RewardError` (``build_reward`` unwraps it from Hydra's InstantiationException)."""


# ---------------------------------------------------------------- stopping


class StopRequested(RuntimeError):
    """Raised by ``stepflow.core.stop.check`` / ``stepflow.core.stop.wait`` when a stop was requested."""
