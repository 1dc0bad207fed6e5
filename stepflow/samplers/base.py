"""The sampler interface: what the core asks of a rollout sampler (docs/guide.md "Extending stepflow").

A sampler is one class named by its YAML's ``_target_`` (``conf/sampler/<name>.yaml``); the YAML's other keys are
its keyword arguments, checked in its own ``__init__`` / ``__post_init__`` (one-line ``ValueError`` starting with the
field's name). The core never compares sampler names: it asks the capability flags below and calls the methods.
The per-sampler math lives in :mod:`stepflow.math.sde` (and :mod:`stepflow.math.solvers`); a sampler class only binds its
parameters to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from stepflow.math.sde import DDIM_SCHEDULES, LOGPROBS, StepOut, _as_time

__all__ = ["Sampler", "grid_times", "check_logprob", "check_eta", "check_a", "check_schedule", "check_bool"]


class Sampler:
    """One rollout sampler: a step ``x_t -> x_s`` (``s < t``) from the model's velocity ``v``, and its noise std.

    Class attributes (capability flags):

    - ``name``: the sampler's name in messages (``sampler=<name>``);
    - ``has_density``: its steps are Gaussian with a log-prob, so its stochastic steps can be trained (False: nothing
      trainable; ode, dpm2);
    - ``multistep``: the rollout keeps the x̂0 of the previous state for :meth:`rollout_step` (dpm2);
    - ``noise_field``: the config field that sets its noise level (``sampler.a``, ``sampler.eta``), named by messages
      that ask to raise it; None when it has none;
    - ``nfe_per_step``: the model evaluations one stochastic step makes. 1: the velocity ``v`` at (x, t), which the
      core evaluates and passes in. More (a predictor-corrector step, lc_langevin): the step evaluates the others
      itself through the ``velocity`` callable that the core then passes to :meth:`step` / :meth:`rollout_step`
      (``velocity(z, t, guided=True) -> v`` with the same policy, weights and prompts as ``v``, under the run's CFG
      scale, or without CFG when ``guided`` is False). They go through the policy, so its NFE counter (``cost/nfe``)
      counts them, with gradients in the update where the step's mean is differentiated.

    Instance attribute ``logprob``: the log-prob convention of its steps (``gaussian`` | ``cps_constfree``).
    """

    name: ClassVar[str] = "sampler"
    has_density: ClassVar[bool] = True
    multistep: ClassVar[bool] = False
    noise_field: ClassVar[str | None] = None
    nfe_per_step: ClassVar[int] = 1
    logprob: str = "gaussian"

    def std(self, t, t_next, t_guard=None) -> Tensor:
        """Per-step std from ``t`` to ``t_next`` (floats, 0-d or (B,) tensors; fp32 of their broadcast shape);
        ``t_guard`` = τ_1 of the grid (for samplers that divide by 1 − t)."""
        raise NotImplementedError(f"{type(self).__name__}.std")

    def step(self, x: Tensor, v: Tensor, t, t_next, *, t_guard=None, noise: Tensor | None = None,
             prev_sample: Tensor | None = None, generator: torch.Generator | None = None) -> StepOut:
        """One step from ``t`` to ``t_next``. x, v: (B, ...) (promoted to fp32); t, t_next: float, 0-d or (B,).
        ``prev_sample`` given: it becomes ``next`` and the log-prob is evaluated at it (with gradients through
        ``v``); else ``next = mean + std·noise`` (``noise ~ N(0, I)`` from ``generator`` when None). A sampler with
        ``nfe_per_step > 1`` also takes ``velocity=`` (the class docstring)."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def rollout_step(self, x: Tensor, v: Tensor, k: int, times: Tensor, *, noise: Tensor,
                     x0_prev: Tensor | None, velocity: Callable[..., Tensor] | None = None) -> StepOut:
        """Step ``k`` of a rollout on the grid ``times`` (T+1,): ``noise`` its ε (B, ...); ``x0_prev`` the x̂0 of the
        previous state (kept by the rollout for a ``multistep`` sampler, else None); ``velocity`` the model (given
        to a sampler with ``nfe_per_step > 1`` only)."""
        extra = {} if velocity is None else {"velocity": velocity}
        return self.step(x, v, times[k], times[k + 1], t_guard=times[1], noise=noise, **extra)

    def describe(self) -> str:
        """The sampler in a message: its name and the settings that change which steps carry noise."""
        return self.name

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "name" not in cls.__dict__:  # a user's sampler without a name: its class name
            cls.name = cls.__name__.lower()


def grid_times(t, t_next) -> tuple[Tensor, Tensor]:
    """``t``, ``t_next`` (floats, 0-d or (B,)) as fp32 tensors of their broadcast shape."""
    return torch.broadcast_tensors(_as_time(t, None), _as_time(t_next, None))


# ----------------------------------------------------------------------------------------------------------------
# field checks, one line each, the field's name first
# ----------------------------------------------------------------------------------------------------------------
def check_logprob(logprob) -> None:
    if logprob not in LOGPROBS:
        raise ValueError(f"logprob: must be one of {LOGPROBS}, got {logprob!r}")


def check_schedule(schedule) -> None:
    if schedule not in DDIM_SCHEDULES:
        raise ValueError(f"schedule: must be one of {DDIM_SCHEDULES}, got {schedule!r}")


def check_a(a) -> None:
    if not (isinstance(a, (int, float)) and math.isfinite(a) and a >= 0):
        raise ValueError(f"a: must be a finite float >= 0, got {a!r}")


def check_eta(eta) -> None:
    """η of a DDIM / CPS schedule: in [0, 1]."""
    if not (isinstance(eta, (int, float)) and 0.0 <= eta <= 1.0):
        raise ValueError(f"eta: must be a float in [0, 1], got {eta!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: must be a bool, got {value!r}")
