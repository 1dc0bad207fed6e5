"""The SDE-window interface: which denoising steps of an iteration follow the sampler (and are trained); the others
take the deterministic Euler step (docs/guide.md "Extending stepflow").

A window is one class named by its YAML's ``_target_`` (``conf/window/<name>.yaml``); the YAML's other keys are its
keyword arguments, checked in its own ``__post_init__`` (one-line ``ValueError`` starting with the field's name). A
window is a pure function of the iteration and the seed, so a resumed run draws the same windows (docs/method.md §9).
The core never compares window names: it calls the methods below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

__all__ = ["Window", "Span", "check_int", "check_fits"]


class Window:
    """An SDE window.

    - ``name``: the window's name in messages (``window=<name>``);
    - :meth:`steps`: the stochastic steps of an iteration (None: every step follows the sampler);
    - :meth:`union`: every step it can hold over a run (None: every step);
    - :meth:`check`: a one-line ValueError when it does not fit a grid;
    - :meth:`tail`: the grid of a solver that replaces the Euler steps after the window (MixGRPO-Flash), or None;
    - :attr:`keeps_states`: False when the rollout leaves the grid after the window (the states after it do not
      exist; only the final latent does).
    """

    name: ClassVar[str] = "window"

    def steps(self, iteration: int, num_steps: int, seed: int = 0) -> list[int] | None:
        """The stochastic steps of ``iteration`` (0-based) on a ``num_steps``-step grid, sorted; None = every step;
        ``[]`` = none (every step follows the ODE and nothing is trained)."""
        raise NotImplementedError(f"{type(self).__name__}.steps")

    def union(self, num_steps: int) -> list[int] | None:
        """Every step the window can hold over a run on a ``num_steps``-step grid, sorted (None: every step)."""
        raise NotImplementedError(f"{type(self).__name__}.union")

    def check(self, num_steps: int) -> None:
        """Raise a one-line ValueError when the window does not fit a ``num_steps``-step grid (by default: what its
        first iteration's :meth:`steps` raises)."""
        self.steps(0, num_steps, 0)

    def tail(self, grid: Tensor, steps: list[int] | None, shift: float) -> Tensor | None:
        """The grid (n,) of the solver that runs from the state after the window's last step to the end instead of
        the grid's Euler steps (:func:`stepflow.core.rollout.rollout` ``tail=``), for the iteration whose window is
        ``steps``; grid: the (T+1,) rollout grid; shift: its shift. None: the grid's Euler steps."""
        return None

    @property
    def keeps_states(self) -> bool:
        """Whether the rollout produces every state of the grid (False: a :meth:`tail` leaves the grid after the
        window, so only the final latent exists after it)."""
        return True

    def describe(self) -> str:
        """The window in a message."""
        return self.name

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if "name" not in cls.__dict__:  # a user's window without a name: its class name
            cls.name = cls.__name__.lower()


def check_int(name: str, value, low: int) -> None:
    """``value`` an integer >= ``low``, else ``<name>: must be an integer >= low, got value``."""
    if not (isinstance(value, int) and value >= low):
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


def check_fits(start: int, size: int, num_steps: int, first: int | None = None) -> None:
    """The window ``[start, start + size)`` fits a ``num_steps``-step grid (``first``: the extent from ``start`` that
    must fit, default ``size``)."""
    if start + (size if first is None else first) > num_steps or size > num_steps - start:
        raise ValueError(f"window.size: start {start} + size {size} do not fit a {num_steps}-step grid "
                         f"(loop.num_steps); lower window.start or window.size")


@dataclass
class Span(Window):
    """A window of ``size`` steps from ``start`` on (the fields and checks that fixed and random share)."""

    start: int = 0
    size: int = 3

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)
        check_int("start", self.start, 0)
