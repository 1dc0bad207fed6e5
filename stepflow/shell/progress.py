"""The run's progress bar (rank 0), telling the truth: its total is the number of iterations the run will do, its
postfix the numbers a user watches."""

from __future__ import annotations

import math


class Progress:
    """A tqdm bar over a :class:`stepflow.grpo.GRPOModule`'s iterations.

    The total is ``loop.iterations``, or with ``loop.budget`` the iterations the budget lasts at the mean cost per
    iteration so far (at most ``loop.iterations``; re-estimated after every iteration; unknown, so no percentage,
    before the first one); when the run ends it is the iterations done, so a finished run ends at 100 %. The postfix:
    the training reward of the last iteration and the last held-out evaluation's GenEval (else its first metric)."""

    def __init__(self, module) -> None:
        from tqdm.auto import tqdm

        self.module = module
        self.shown: dict[str, str] = {}
        self.bar = tqdm(total=self.total(), initial=module.iteration, desc="GRPO", unit="it", dynamic_ncols=True)

    def total(self, done: bool = False) -> int | None:
        m = self.module
        if done:
            return m.iteration
        cap, budget = m.loop.iterations, m.budget
        if budget is None:
            return cap
        spent = float(m.spent[budget.kind])
        if m.iteration == 0 or spent <= 0:
            return None
        left = max(0.0, budget.total - spent)
        return min(cap, m.iteration + math.ceil(left / (spent / m.iteration)))

    def advance(self, metrics: dict[str, float], done: bool) -> None:
        """After an iteration (``done``: the run ends with it)."""
        reward = metrics.get("train/reward_final", metrics.get("train/reward_mean"))
        if reward is not None:
            self.shown["reward"] = f"{reward:.3f}"
        self.bar.total = self.total(done)
        self.bar.set_postfix(self.shown, refresh=False)
        self.bar.update(1)

    def evaluated(self, metrics: dict[str, float]) -> None:
        """After a held-out evaluation."""
        keys = ["eval/geneval"] if "eval/geneval" in metrics else sorted(k for k in metrics if k.startswith("eval/"))
        if keys:
            self.shown["geneval" if keys[0] == "eval/geneval" else keys[0][5:]] = f"{metrics[keys[0]]:.3f}"
            self.bar.set_postfix(self.shown)

    def close(self) -> None:
        self.bar.close()
