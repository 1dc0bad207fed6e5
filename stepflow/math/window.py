"""SDE windows: which denoising steps of an iteration are stochastic (and trained); the others follow the ODE.

A window is a pure function of the iteration (and the seed), so a resumed run draws the same windows (docs/method.md
§9). The built-in options of the ``window`` config group, one class each in :mod:`stepflow.windows` (on the
interface :class:`stepflow.windows.base.Window`; this module keeps MixGRPO's released position arithmetic, the
by-name factory :func:`WindowConfig` and the functional :func:`window_steps` / :func:`post_tail`):

- ``none``: every step follows the sampler (the paper);
- ``fixed``: steps ``[start, start + size)`` (Flow-GRPO-Fast's window);
- ``sliding``: a simplified MixGRPO progressive window of ``size`` steps, moved by ``stride`` every ``every``
  iterations from ``start`` up to the last position (``T − size``), then held there (stepflow's, kept as measured);
- ``random``: ``size`` steps drawn anew every iteration from ``[start, T)``, the same for every sample (MixGRPO-random
  semantics; not DanceGRPO's subset, which trains a per-sample subset of all-SDE rollouts, league.md §0);
- ``random_start``: ``size`` consecutive steps at a start drawn anew every iteration, the window inside
  ``[start, end)`` (Flow-GRPO-Fast as released: ``start = random.randint(range[0], range[1] − size)``,
  window_range (0, 5), window_size 3);
- ``mixgrpo``: MixGRPO's progressive window as released (:func:`mixgrpo_window`): ``range(cur, min(cur + size, T − 2))``
  with ``cur`` moved by ``stride`` every ``every`` iterations; the window shrinks at the end of the grid and is empty
  at ``cur = T − 2``, after which it rolls back to ``start`` (``roll_back``) or stays empty. ``post_solver=dpmpp2m``
  (MixGRPO-Flash): the ODE after the window is a DPM-Solver++(2M) tail on a compressed grid (``Window.tail``,
  :func:`stepflow.math.solvers.flash_tail`) instead of the grid's Euler steps.

Steps outside the window carry no log-prob and are never trained; the x̂0 estimates and rewards of their states are
still computed where the credit scheme reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from stepflow.math.sde import CONF_DIR

if TYPE_CHECKING:
    from stepflow.windows.base import Window

__all__ = ["WindowConfig", "window_steps", "mixgrpo_window", "mixgrpo_position", "post_tail", "WINDOWS",
           "POST_SOLVERS"]

#: the package's window options (``conf/window/*.yaml``)
WINDOWS = tuple(sorted(p.stem for p in (CONF_DIR / "window").glob("*.yaml")))
#: the ODE after the window: the grid's Euler steps, or MixGRPO-Flash's compressed DPM-Solver++(2M) tail
POST_SOLVERS = ("euler", "dpmpp2m")


def WindowConfig(kind: str, **fields: Any) -> Window:  # noqa: N802 - the name of the old config class
    """The window of option ``kind`` (``conf/window/<kind>.yaml``: its ``_target_`` class, with the YAML's fields
    updated by ``fields``), for code and tests that build a window by its option name. A one-line ValueError for an
    unknown option (``kind: must be one of ...``) or a field the class does not take.
    See :class:`stepflow.windows.base.Window` and :mod:`stepflow.windows`."""
    from stepflow.core.parts import CONF_DIR as conf
    from stepflow.core.parts import from_option

    return from_option("window", kind, [conf], key="kind", **fields)


def window_steps(cfg: Window, iteration: int, num_steps: int, seed: int = 0) -> list[int] | None:
    """The stochastic steps of ``iteration`` on a ``num_steps``-step grid, sorted: ``cfg.steps(...)``; None = every
    step (``none``); ``mixgrpo`` may give ``[]`` (every step follows the ODE and nothing is trained)."""
    return cfg.steps(iteration, num_steps, seed)


# ----------------------------------------------------------------------------------------------------------------
# MixGRPO's progressive window as released (Tencent-Hunyuan/MixGRPO@e5cdd6a)
# ----------------------------------------------------------------------------------------------------------------
def _mixgrpo_last(cfg: Window, num_steps: int) -> int:
    """``max_timesteps = sampling_steps − 2`` (fastvideo/train_grpo_flux.py L919), checked against ``start``."""
    last = num_steps - 2
    if not 0 <= cfg.start < last:
        raise ValueError(f"window.start: the mixgrpo window runs over the steps start .. T - 3 (T = loop.num_steps = "
                         f"{num_steps}; MixGRPO's max_timesteps = T - 2 is exclusive), so start must be in "
                         f"0..{last - 1}, got {cfg.start}; lower window.start or raise loop.num_steps")
    return last


def mixgrpo_position(cfg: Window, iteration: int, num_steps: int) -> int:
    """``cur_timestep`` of ``GRPOTrainingStates`` (fastvideo/utils/grpo_states.py) when iteration ``iteration``
    (0-based) reads its window, in closed form.

    Released (``sample_strategy="progressive"``, ``prog_overlap=True``; grpo_states.py L85-99, called at
    train_grpo_flux.py L945-947 as ``get_current_timesteps()`` then ``update_iteration()``): every iteration
    ``cur_iter_in_group += 1``; when it reaches ``iters_per_group`` (= ``every``) it is reset and ``cur_timestep +=
    prog_overlap_step`` (= ``stride``); then, if ``cur_timestep > max_timesteps`` (M = T − 2), ``roll_back`` resets it
    to the initial ``start`` (and the counter to 0), else clips it to M. Hence, with ``P = ⌊(M − start)/stride⌋ + 1``
    positions per cycle (stride ≥ 1):

        roll_back:     cur(i) = start + ⌊(i mod P·every) / every⌋ · stride
        no roll_back:  cur(i) = min(start + ⌊i / every⌋ · stride, M)

    and ``cur(i) = start`` for ``stride = 0`` (MixGRPO-Flash*: ``prog_overlap_step=0``, a frozen window).
    """
    if not (isinstance(iteration, int) and iteration >= 0):
        raise ValueError(f"iteration: must be an integer >= 0, got {iteration!r}")
    last = _mixgrpo_last(cfg, num_steps)
    if cfg.stride == 0:
        return cfg.start
    if cfg.roll_back:
        positions = (last - cfg.start) // cfg.stride + 1
        return cfg.start + ((iteration % (positions * cfg.every)) // cfg.every) * cfg.stride
    return min(cfg.start + (iteration // cfg.every) * cfg.stride, last)


def mixgrpo_window(cfg: Window, iteration: int, num_steps: int) -> list[int]:
    """MixGRPO's SDE (and trained) steps of ``iteration``: ``range(cur, min(cur + size, T − 2))`` with ``cur`` =
    :func:`mixgrpo_position` (``get_current_timesteps``, fastvideo/utils/grpo_states.py L141-148; ``group_size`` =
    ``size``). The end is exclusive, so the last step a window holds is T − 3 (released: 22 of 0..24 at 25 steps): near
    the end the window shrinks (``[T − 4, T − 3]``, ``[T − 3]``) and at ``cur = T − 2`` it is **empty**; the released
    rollout then samples every step with the Euler ODE (train_grpo_flux.py L236-240: ``determistic`` all True) and
    the update's loop over the window is empty (L532-533), so nothing is trained (the optimizer step sees no
    gradient). Example (T = 10, size 4, stride 1, every 25, roll_back): iterations 0-24 → [0, 1, 2, 3], 25-49 →
    [1, 2, 3, 4], …, 125-149 → [5, 6, 7], 150-174 → [6, 7], 175-199 → [7], 200-224 → [], 225 → [0, 1, 2, 3] again."""
    cur = mixgrpo_position(cfg, iteration, num_steps)
    return list(range(cur, min(cur + cfg.size, num_steps - 2)))


def post_tail(cfg: Window | None, grid: Tensor, window: list[int] | None, shift: float) -> Tensor | None:
    """The window's post-window tail grid for one iteration: ``cfg.tail(grid, window, shift)`` (MixGRPO-Flash's
    DPM-Solver++(2M) tail, :meth:`stepflow.windows.mixgrpo.MixGrpo.tail`), which :func:`stepflow.core.rollout.rollout`
    (``tail=``) runs from ``X_{last+1}`` to the final latent; None (the grid's Euler steps after the window) for no
    window or a window without a tail. grid: the (T+1,) rollout grid; shift: the grid's shift."""
    return None if cfg is None else cfg.tail(grid, window, shift)
