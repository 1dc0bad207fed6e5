"""What a run carries between iterations and across a resume, beside the weights: the counters (iterations,
optimizer steps, NFEs, reward images, the budget spent), the credit's, EMA's, weighting's and objective's state, the
metric history and the RNG (:class:`stepflow.grpo.GRPOModule` checkpoints it under ``checkpoint["stepflow"]``)."""

from __future__ import annotations

import torch

from stepflow.core.budget import parse_budget


def save(module) -> dict:
    """The run state of ``module`` (a GRPOModule), for ``checkpoint["stepflow"]``."""
    learner = module.learner
    return {
        "iteration": module.iteration, "opt_steps": learner.opt_steps, "nfe_total": module.nfe_total,
        "reward_images_total": module.reward_images_total, "spent": dict(module.spent),
        "credit": learner.advantage.state_dict(),
        "ema": None if module.ema is None else module.ema.state_dict(), "history": module.history,
        "torch_rng": torch.get_rng_state(),
        "signal": learner.weighting.state_dict(), "objective": module.objective.state_dict(),
        "eval_pending": module.eval_pending,
    }


def load(module, s: dict) -> None:
    """Restore :func:`save`'s state into ``module`` (a checkpoint from before ``loop.budget``: the budget spent is
    summed from its history, the same counters)."""
    learner = module.learner
    module.iteration, learner.opt_steps = s["iteration"], s["opt_steps"]
    module.nfe_total, module.reward_images_total = s["nfe_total"], s["reward_images_total"]
    learner.advantage.load_state_dict(s["credit"])
    if module.ema is not None and s["ema"] is not None:
        module.ema.load_state_dict(s["ema"])
    module.history = list(s["history"])
    module.spent = dict(s.get("spent") or {
        "nfe": sum(float(h.get("cost/nfe_fwd_equiv", 0.0)) for h in module.history),
        "seconds": sum(float(h.get("time/iteration_s", 0.0)) for h in module.history)})
    learner.weighting.load_state_dict(s.get("signal"))
    if s.get("objective"):
        module.objective.load_state_dict(s["objective"])
    module.eval_pending = bool(s.get("eval_pending", False))
    for lg in module.loggers:
        if hasattr(lg, "restore"):
            lg.restore(module.history)
    torch.set_rng_state(s["torch_rng"])


def count(module, m: dict[str, float], dist) -> None:
    """Add one iteration's metrics ``m`` to the run's counters, and the running totals to ``m``: NFEs and reward
    images; the budget's counters, identical on every rank (NFEs are summed over ranks, seconds the slowest
    rank's)."""
    module.iteration += 1
    module.nfe_total += int(m["cost/nfe"])
    module.reward_images_total += int(m["cost/reward_images"])
    m["cost/nfe_total"], m["cost/reward_images_total"] = module.nfe_total, module.reward_images_total
    module.spent["nfe"] += float(m["cost/nfe_fwd_equiv"])
    module.spent["seconds"] += dist.all_max(float(m["time/iteration_s"]))
    m["cost/nfe_fwd_equiv_total"], m["cost/train_seconds_total"] = module.spent["nfe"], module.spent["seconds"]
    if module.budget is not None:
        m["budget/fraction"] = module.budget.fraction(module.spent)


def check_resume_trains(module) -> None:
    """At the start of training (``module``: a GRPOModule): a resume whose ``loop.budget`` / ``loop.iterations`` is
    below what the run already did would train nothing and exit as a finished run: refused in one line (a finished
    run resumed with its own settings, a requeue of ``ckpt_path=auto``, is not: its ``config.yaml`` says it was
    done)."""
    if module.iteration == 0 or module.eval_pending:
        return
    by_budget, by_iterations = module._budget_spent(), module.iteration >= module.loop.iterations
    if not (by_budget or by_iterations):
        return
    try:
        import yaml

        saved = (yaml.safe_load((module.run_dir / "config.yaml").read_text()) or {}).get("loop") or {}
        old_budget = parse_budget(saved.get("budget"))
        was_done = module.iteration >= int(saved.get("iterations", 0)) or (
            old_budget is not None and old_budget.spent_all(module.spent))
    except (OSError, ValueError, TypeError, AttributeError, ImportError):
        return  # no readable record of the run's own settings: nothing to compare
    if was_done:
        return
    from stepflow.errors import StepflowError

    if by_budget:
        spent = module.spent[module.budget.kind]
        done = f"{spent:,.0f} forward-equivalent NFEs" if module.budget.kind == "nfe" else f"{spent:.0f} s of training"
        raise StepflowError(f"loop.budget: this resume's budget ({module.budget}) is below what the run already spent "
                            f"({done} in {module.iteration} iterations), so it would train nothing; give loop.budget "
                            f"above that (the run's own: {saved.get('budget')}) or start a new run")
    raise StepflowError(f"loop.iterations: this resume's loop.iterations={module.loop.iterations} is not above the "
                        f"iterations the run already did ({module.iteration}), so it would train nothing; give "
                        f"loop.iterations > {module.iteration} (the run's own: {saved.get('iterations')}) or start a "
                        "new run")
