"""``loop.budget``: a run's compute budget, for comparisons of methods at equal compute (docs/guide.md, "Budgets").

A budget is a number of forward-equivalent NFEs (``loop.budget=2e5``) or of training seconds (``loop.budget=420s``).
Forward-equivalent NFEs are the iterations' ``cost/nfe_fwd_equiv`` summed over ranks: one transformer forward per
sample (CFG's two halves count two), a backward counted as two forwards; the reward model's images are counted
apart (``cost/reward_images``). Training seconds are the iterations' own phases (``time/iteration_s``, the slowest
rank's), not the held-out evaluations or the checkpoints. A run stops after the iteration that reaches its budget
(the overshoot is at most that iteration; ``budget/fraction`` logs where it ended) and evaluates on the held-out set
after the iterations that reach each of ``eval.at_fractions`` of it. What was spent is checkpointed, so a resumed
run stops where the uninterrupted one does (exactly for NFEs, which are counted; seconds are measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Budget", "parse_budget", "crossed"]

@dataclass(frozen=True)
class Budget:
    kind: str  #: ``nfe`` (forward-equivalent NFEs) | ``seconds`` (training seconds)
    total: float

    def fraction(self, spent: dict[str, float]) -> float:
        """The fraction of the budget ``spent`` ({kind: amount}) holds."""
        return float(spent.get(self.kind, 0.0)) / self.total

    def spent_all(self, spent: dict[str, float]) -> bool:
        return float(spent.get(self.kind, 0.0)) >= self.total

    def reaches(self, before: dict[str, float], after: dict[str, float], fractions: Sequence[float]) -> bool:
        """Whether the iteration that took the spent amounts from ``before`` to ``after`` reaches one of
        ``fractions`` of the budget (:func:`crossed`)."""
        return bool(crossed(before[self.kind], after[self.kind], self.total, fractions))

    def warn_capped(self, iterations: int, spent: dict[str, float]) -> None:
        """Say that ``loop.iterations`` ended the run before the budget did."""
        import logging

        logging.getLogger("stepflow.train").warning(
            f"loop.iterations={iterations} reached at {self.fraction(spent):.0%} of loop.budget ({self}); raise "
            "loop.iterations to spend all of it")

    def __str__(self) -> str:
        return f"{self.total:,.0f} forward-equivalent NFEs" if self.kind == "nfe" else f"{self.total:g} s of training"


def parse_budget(value: Any) -> Budget | None:
    """``loop.budget``: None → no budget; a number (or its string, ``2e5``) → forward-equivalent NFEs; ``"<N>s"`` →
    training seconds. Raises ``ValueError`` naming the field and the accepted forms for anything else."""
    if value is None:
        return None
    form = "a number of forward-equivalent NFEs (2e5) or of training seconds ('420s'), > 0, or null"
    if isinstance(value, bool):
        raise ValueError(f"budget: must be {form}, got {value!r}")
    kind, text = "nfe", value
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("s"):
            kind, text = "seconds", text[:-1]
    try:
        total = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"budget: must be {form}, got {value!r}") from None
    if not total > 0 or total == float("inf"):
        raise ValueError(f"budget: must be {form}, got {value!r}")
    return Budget(kind, total)


def crossed(before: float, after: float, total: float, fractions: Sequence[float]) -> list[float]:
    """The fractions f of ``total`` that an iteration taking the spent amount from ``before`` to ``after`` reaches:
    ``before < f·total ≤ after`` (each fraction is reached by exactly one iteration of a run)."""
    return [f for f in fractions if before < f * total <= after]
