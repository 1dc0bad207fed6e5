"""Plots people look at: reward curves of a run (PNG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(history: Sequence[dict[str, float]], path: str | Path, title: str = "stepflow run") -> Path:
    """Train reward vs iteration (left) and held-out eval metrics vs iteration (right), from logged rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    train = [(h["iteration"], h["train/reward_final"]) for h in history if "train/reward_final" in h]
    evals: dict[str, list[tuple[float, float]]] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith("eval/") and not k.startswith("eval/geneval_"):  # per-category rows stay in metrics.csv
                evals.setdefault(k, []).append((h["iteration"], v))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    if train:
        x, y = zip(*train)
        axes[0].plot(x, y, lw=1.2)
    axes[0].set(title="train reward (final image)", xlabel="iteration", ylabel="reward")
    for k, pts in evals.items():
        x, y = zip(*pts)
        axes[1].plot(x, y, marker="o", label=k)
    axes[1].set(title="held-out evaluation (ODE, EMA)", xlabel="iteration")
    if evals:
        axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
