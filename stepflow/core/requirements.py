"""Compatibility declared, not coded: the cross-field requirements of a training config as rows over the parts'
capability flags, checked in one place before anything loads (``stepflow.train.settings``).

Each row is ``(name, fails(s), message(s))`` over the typed settings ``s`` (:class:`stepflow.train.Settings`: the
built parts ``s.sampler``, ``s.advantage`` (the credit), ``s.objective``, ``s.window`` and the typed groups); the
first failing row is one line naming the field and the fix. Rows ask flags (``needs_density``, ``has_density``,
``branched``, ``keeps_states``, ``forward_process``, ``needs_stepwise_rewards``, ``per_step``, ...), never option
names, so a user's part meets the same rows as a built-in. A part adds rows of its own with ``requirements(s)``
(a list of messages for the requirements that fail: :class:`stepflow.objectives.forward.Awm`'s training times).
Warnings (``WARN``) are logged, not raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from stepflow.errors import StepflowError

__all__ = ["ROWS", "WARN", "check", "failures", "candidate_steps", "noise_free_steps", "edit_failures"]

Row = tuple[str, Callable[[Any], bool], Callable[[Any], str]]


def _grid(s):
    from stepflow.math.sde import time_grid

    return time_grid(s.loop.num_steps, shift=1.0)  # noise-free steps do not depend on the shift (σ = 0 at the ends)


def candidate_steps(s, density: bool = True) -> list[int]:
    """The steps the first iteration would train (its window, ``train.train_steps``, the sampler's noise)."""
    from stepflow.objectives.base import trainable_steps

    return trainable_steps(s.train, s.sampler, _grid(s), density, s.window.steps(0, s.loop.num_steps, 0))


def noise_free_steps(s) -> list[int]:
    g = _grid(s)
    return [k for k in range(s.loop.num_steps) if float(s.sampler.std(g[k], g[k + 1], t_guard=g[1])) == 0]


def _listed_outside(s) -> list[int]:
    return [k for k in (s.train.train_steps or []) if not 0 <= k < s.loop.num_steps]


def _listed_quiet(s) -> bool:
    """Listed steps that all carry no noise, under a sampler with a density and an objective that needs one."""
    steps = s.train.train_steps
    if steps is None or not (s.sampler.has_density and s.objective.needs_density):
        return False
    return not set(steps) - set(noise_free_steps(s))


def _trains_nothing(s) -> bool:
    from stepflow.objectives.base import trainable_steps

    if not s.sampler.has_density and s.objective.needs_density:
        return False  # a rollout-only run: WARN says so
    return not trainable_steps(s.train, s.sampler, _grid(s), s.objective.needs_density, s.window.union(s.loop.num_steps))


def _chosen(s) -> str:
    steps, t = s.train.train_steps, s.loop.num_steps
    if isinstance(steps, list):
        return f"train.train_steps={list(steps)}"
    if s.train.timestep_fraction < 1:
        return f"the first int(T·train.timestep_fraction) = {int(t * s.train.timestep_fraction + 1e-9)} steps"
    return "every noisy step"


def _nothing_message(s) -> str:
    t, union = s.loop.num_steps, s.window.union(s.loop.num_steps)
    if union is not None:
        return (f"window: the SDE window (window={s.window.name}, steps {union[0]}..{union[-1]} of 0..{t - 1}) holds no "
                f"step that is trained ({_chosen(s)}; steps {noise_free_steps(s)} carry no noise under "
                f"sampler={s.sampler.name}), so nothing would be trained; move window.start / window.size over "
                "trained noisy steps, or change train.train_steps")
    field = "train.timestep_fraction" if s.train.timestep_fraction < 1 else (s.sampler.noise_field or "sampler")
    return (f"{field}: no step of the {t}-step grid carries noise ({_chosen(s)} under sampler={s.sampler.name}), "
            f"so nothing would be trained; raise {field}")


def _per_step(s) -> bool:
    from stepflow.math.weighting import build_weighting

    return build_weighting(s.train.weighting).per_step


def _subset_empty(s) -> bool:
    from stepflow.core.update import steps_per_sample

    if s.train.step_subset is None or not s.sampler.has_density:
        return False
    cand = candidate_steps(s)
    return bool(cand) and steps_per_sample(len(cand), s.train.step_fraction) == 0


def _branched(s) -> bool:
    return s.advantage.branched


def _window_not_from_zero(s) -> bool:
    if not (s.advantage.trains_window_from_zero and s.objective.needs_density and s.sampler.has_density):
        return False
    cand = candidate_steps(s)
    return bool(cand) and cand != list(range(len(cand)))


def _window_from_zero_message(s) -> str:
    name = s.advantage.name
    if 0 in noise_free_steps(s):  # no window or step list can start the trained steps at 0: the sampler must
        return (f"sampler={s.sampler.describe()}: advantage={name} trains an SDE window that starts at step 0 "
                f"(TurningPoint-GRPO's sde_window_range (0, n)), but step 0 carries no noise under this sampler, so "
                f"no window can start there; choose a sampler (or a setting of it) whose step 0 is noisy, "
                "e.g. sampler=flow_sde")
    return (f"advantage={name}: the trained steps must be a window that starts at step 0 (TurningPoint-GRPO's "
            f"sde_window_range (0, n)), got {candidate_steps(s)}; use window=fixed window.start=0 or "
            "train.train_steps=null")


def _same_latent(s) -> bool:
    """Whether a group shares its initial noise (the objective's own ``same_latent``, else ``loop.same_latent``)."""
    own = getattr(s.objective, "same_latent", None)
    return bool(s.loop.same_latent if own is None else own)


def _identical_groups(s) -> bool:
    """A group's samples are one sample repeated: shared initial noise and a sampler that adds none at any step
    (the window's steps follow the sampler too). Rollout-only runs are left to WARN."""
    if not _same_latent(s) or (s.objective.needs_density and not s.sampler.has_density):
        return False
    return len(noise_free_steps(s)) == s.loop.num_steps


def _identical_message(s) -> str:
    field = "objective.same_latent" if getattr(s.objective, "same_latent", None) is not None else "loop.same_latent"
    by = ("objective.rollout_sampler=" + str(s.objective.rollout_sampler)
          if getattr(s.objective, "rollout_sampler", None) else f"sampler={s.sampler.describe()}")
    return (f"{field}=true: every sample of a group starts from the same noise and {by} adds none at any step, so "
            f"the group's samples are identical, every advantage is 0 and objective={s.objective.name} learns nothing "
            f"(train/grad_norm 0); set {field}=false (each sample its own noise) or use a stochastic sampler (e.g. sampler=flow_sde)")


def _default_fractions() -> list[float]:
    from stepflow.config import EvalConfig

    return list(EvalConfig().at_fractions)


def _retain_why_not(s) -> str | None:
    """``loop.retain_graph=true`` where the update cannot train from the rollout's graphs (:func:`stepflow.core.retain.
    why_not`, retain's own table of reasons)."""
    from stepflow.core import retain

    if retain.mode(s.loop.retain_graph) != "on":
        return None
    return retain.why_not(updates_per_iter=s.train.updates_per_iter, update_per_step=s.train.update_per_step,
                          forward_process=s.objective.forward_process,
                          branched=s.advantage.name if s.advantage.branched else None,
                          per_step_weighting=s.train.weighting if _per_step(s) else None, strategy=s.strategy)


def _trains(s) -> str:
    """What the credit's branched rollout strategy trains, in its refusals (``RolloutStrategy.trains``)."""
    return s.advantage.rollout_strategy().trains

def _model_edits(s) -> bool | None:
    """Whether the model edits a source image (``FlowPolicy.takes_source`` of its config's ``_target_``; None: the
    target does not say, checked again once the policy is built)."""
    from stepflow.policies.base import takes_source

    return takes_source(getattr(s, "model", None))


def edit_failures(s, model_edits: bool | None) -> list[str]:
    """The data set, the model and the reward agree on source images: an edit data set (``data.source_key``) needs
    an editing model and a text-only one a text-to-image model (``model_edits``: the model's ``takes_source``, None:
    unknown); a reward that reads the source (``reads_source``) needs an edit data set."""
    data = getattr(s, "data", None)
    key, name = getattr(data, "source_key", None), getattr(s, "model_name", "?")
    if not key and model_edits is not True and not getattr(getattr(s, "reward", None), "reads_source", False):
        return []
    out = []
    if key and model_edits is False:
        out.append(f"data.source_key={key}: data={s.data.name} is an edit data set (each prompt edits a source image), "
                   f"which model={name} (text-to-image) cannot take; choose an editing model (model=flux_kontext, "
                   f"model=qwen_image_edit) or a text-to-image data set (data.source_key=null)")
    if not key and model_edits is True:
        out.append(f"data={s.data.name}: model={name} edits a source image, but data={s.data.name} has text prompts "
                   f"only (data.source_key=null); use an edit data set (e.g. data=edit_tiny, or data.source_key=<the "
                   f"records' image field>) or a text-to-image model")
    reward = getattr(s, "reward", None)
    if not key and getattr(reward, "reads_source", False) is True:
        out.append(f"reward: {getattr(reward, 'name', type(reward).__name__)} scores an edit against its source "
                   f"image, which data={s.data.name} does not give (data.source_key=null); use an edit data set (e.g. "
                   f"data=edit_tiny) or a reward that reads no source")
    return out


#: (name, fails, message): checked in order, the first failing row raised as one line
ROWS: list[Row] = [
    ("source images: data, model, reward", lambda s: bool(edit_failures(s, _model_edits(s))),
     lambda s: edit_failures(s, _model_edits(s))[0]),
    ("train_steps in the grid", lambda s: bool(_listed_outside(s)),
     lambda s: f"train.train_steps: step {_listed_outside(s)[0]!r} is outside 0..{s.loop.num_steps - 1} (loop.num_steps="
               f"{s.loop.num_steps}); use step indices or train.train_steps=null for every stochastic step"),
    ("weighting weighs SDE steps", lambda s: s.objective.forward_process and s.train.weighting != "none",
     lambda s: f"train.weighting={s.train.weighting}: weighs the rollout's SDE steps, which objective={s.objective.name} "
               "does not train (it trains re-noised final samples); use train.weighting=none"),
    ("objective reads stepwise advantages",
     lambda s: getattr(s.objective, "needs_stepwise_advantages", False) and not s.advantage.needs_stepwise_rewards,
     lambda s: f"objective={s.objective.name}: weights its targets by the gain advantages, which "
               f"advantage={s.advantage.name} does not compute; use a gain scheme (advantage=gain)"),
    ("listed steps carry noise", _listed_quiet,
     lambda s: f"train.train_steps: steps {list(s.train.train_steps)} carry no noise under sampler="
               f"{s.sampler.describe()}, so nothing would be trained; pick stochastic steps or train.train_steps=null"),
    ("something is trained", _trains_nothing, _nothing_message),
    ("step subset: transitions", lambda s: s.train.step_subset is not None and not s.objective.needs_density,
     lambda s: f"train.step_subset={s.train.step_subset}: draws each sample's trained SDE steps, which "
               f"objective={s.objective.name} does not train; use objective=grpo or train.step_subset=null"),
    ("step subset: per-step weighting", lambda s: s.train.step_subset is not None and _per_step(s),
     lambda s: f"train.step_subset={s.train.step_subset}: each sample trains its own steps, which "
               f"train.weighting={s.train.weighting} (whole per-step gradients) cannot combine; use "
               "train.weighting=none (or noise, gain_var, guard)"),
    ("step subset: a step per sample", _subset_empty,
     lambda s: f"train.step_fraction: int({len(candidate_steps(s))} trained steps x {s.train.step_fraction}) = 0, so "
               f"no sample would train a step; raise train.step_fraction to at least 1/{len(candidate_steps(s))}"),
    ("post-window tail: GRPO", lambda s: not s.window.keeps_states and not s.objective.needs_density,
     lambda s: f"window.post_solver={s.window.post_solver}: MixGRPO-Flash trains the rollout's SDE window with GRPO, "
               f"not objective={s.objective.name}; use objective=grpo or window.post_solver=euler"),
    ("post-window tail: final reward", lambda s: not s.window.keeps_states and s.advantage.needs_stepwise_rewards,
     lambda s: f"window.post_solver={s.window.post_solver}: the Flash rollout keeps no state between the window and the "
               f"final image, which advantage={s.advantage.name} reads; use advantage=uniform or "
               "window.post_solver=euler"),
    ("branches: GRPO", lambda s: _branched(s) and not s.objective.needs_density,
     lambda s: f"objective={s.objective.name}: advantage={s.advantage.name} {_trains(s)}; use objective=grpo"),
    ("branches: no window", lambda s: _branched(s) and s.window.union(s.loop.num_steps) is not None,
     lambda s: f"window={s.window.name}: advantage={s.advantage.name} {_trains(s)} (its rollout has no SDE window); use "
               "window=none and train.train_steps to choose the steps"),
    ("branches: no step subset", lambda s: _branched(s) and s.train.step_subset is not None,
     lambda s: f"train.step_subset={s.train.step_subset}: advantage={s.advantage.name} {_trains(s)}, each branch row at "
               "its own step; set train.step_subset=null"),
    ("branches: no per-step weighting", lambda s: _branched(s) and _per_step(s),
     lambda s: f"train.weighting={s.train.weighting}: advantage={s.advantage.name} {_trains(s)}, each branch row at its "
               "own step, which whole per-step gradients cannot combine; use train.weighting=none or noise"),
    ("branches: an SDE", lambda s: _branched(s) and not s.sampler.has_density,
     lambda s: f"sampler={s.sampler.name}: advantage={s.advantage.name} {_trains(s)}, drawn by the sampler's SDE; use "
               f"{s.advantage.rollout_strategy().sde_hint}"),
    ("window from step 0", _window_not_from_zero, _window_from_zero_message),
    ("sharded: whole per-step gradients", lambda s: s.strategy in ("fsdp", "deepspeed") and _per_step(s),
     lambda s: f"train.weighting={s.train.weighting}: combines whole per-step gradients, which trainer={s.strategy} "
               "shards; use trainer=ddp (or ddp_cpu) for it, or another train.weighting"),
    ("retained graphs", lambda s: _retain_why_not(s) is not None,
     lambda s: f"loop.retain_graph=true: {_retain_why_not(s)}; set loop.retain_graph=false (or auto)"),
]

#: (fails, message): logged as warnings
WARN: list[tuple[Callable[[Any], bool], Callable[[Any], str]]] = [
    (lambda s: not s.sampler.has_density and s.objective.needs_density,
     lambda s: f"sampler={s.sampler.name} has no density: this run rolls out and scores, and trains nothing "
               "(train/steps_trained=0); use a stochastic sampler (ddim_sde, flow_sde, cps) to train, or an objective "
               "without log-probs (objective=nft, awm, advantageflow, distill)"),
    (_identical_groups, _identical_message),
    (lambda s: s.loop.budget is None and list(s.eval.at_fractions) != _default_fractions(),
     lambda s: f"eval.at_fractions={list(s.eval.at_fractions)}: evaluates at fractions of loop.budget, which this run "
               "does not set (loop.budget=null), so it does nothing; set loop.budget=<NFEs, or '<N>s'> or use "
               "eval.every"),
    (lambda s: _branched(s) and s.loop.overlap_reward,
     lambda s: f"loop.overlap_reward: does not apply to advantage={s.advantage.name} (one reward call for every "
               "branch image)"),
]


def failures(s) -> list[str]:
    """Every failing row's message, the rows of the parts (``part.requirements(s)``) after the core's."""
    out = [msg(s) for _, fails, msg in ROWS if fails(s)]
    for part in (s.sampler, s.advantage, s.objective, s.window):
        out += list(getattr(part, "requirements", lambda _: [])(s))
    return out


def check(s) -> None:
    """Raise the first failing requirement as one line (:class:`StepflowError`); log the warnings."""
    try:
        s.window.check(s.loop.num_steps)
    except ValueError as e:
        raise StepflowError(str(e)) from None
    for _, fails, msg in ROWS:
        if fails(s):
            raise StepflowError(msg(s))
    for part in (s.sampler, s.advantage, s.objective, s.window):
        for msg in getattr(part, "requirements", lambda _: [])(s):
            raise StepflowError(msg)
    for fails, msg in WARN:
        if fails(s):
            logging.getLogger("stepflow.train").warning(msg(s))
