"""GRPOModule: the Lightning shell around :func:`stepflow.algorithm.iteration` (one epoch = one GRPO iteration).

The algorithm itself is Lightning-free (``stepflow/algorithm.py``). This module owns what Lightning is for: the
optimizer, manual optimization under DDP / FSDP / DeepSpeed, checkpoint state (iteration counters, EMA, the
advantage estimator's state, the metric history, the RNG), logging, and the evaluation schedule (held-out prompts,
ODE sampling with the EMA weights, at the start, every ``eval.every`` iterations and at the end).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import lightning as L
import torch

from stepflow.algorithm import Learner, iteration, iteration_metrics
from stepflow.config import EmaConfig, EvalConfig, LoopConfig, TrainConfig
from stepflow.data import PromptPlanner
from stepflow.dist import Dist
from stepflow.ema import ParamEMA
from stepflow.errors import RewardServiceError, StopRequested
from stepflow.policies.base import FlowPolicy
from stepflow.rewards.base import Reward

__all__ = ["GRPOModule"]


class GRPOModule(L.LightningModule):
    """Stepwise-Flow-GRPO / Flow-GRPO training (manual optimization).

    Args:
        policy: a FlowPolicy with a LoRA adapter added, or fully fine-tuned (``policy.trainable_parameters()``).
        reward: the training reward (also scores the evaluation).
        sampler / advantage: the rollout sampler and the credit (parts: :mod:`stepflow.samplers`,
            :mod:`stepflow.credits`).
        objective: what the update minimises (a part, :mod:`stepflow.objectives`; None: GRPO).
        window: the SDE window (a part, :mod:`stepflow.windows`; None: every step follows the sampler).
        plan: the group sampler over the training prompts.
        eval_records: held-out prompt records.
        loop / train / eval_cfg / ema: the configs of ``stepflow.config``.
        run_dir: where grids, plots and the adapter go.
    """

    def __init__(self, policy: FlowPolicy, reward: Reward, sampler: Any, advantage: Any,
                 plan: PromptPlanner, eval_records: list[dict], loop: LoopConfig, train: TrainConfig,
                 eval_cfg: EvalConfig, ema: EmaConfig, run_dir: str | Path = ".", window=None, objective: Any = None):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the trained weights
        self.policy, self.reward = policy, reward
        self.loop, self.train_cfg, self.eval_cfg = loop, train, eval_cfg
        self.eval_records = eval_records
        self.run_dir = Path(run_dir)
        self.iteration = 0
        self.nfe_total = 0
        self.reward_images_total = 0
        from stepflow.budget import parse_budget

        self.budget = parse_budget(loop.budget)  #: loop.budget (None: loop.iterations decides)
        #: what the iterations spent (stepflow.budget): forward-equivalent NFEs over ranks, training seconds
        self.spent = {"nfe": 0.0, "seconds": 0.0}
        self.history: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        #: an evaluation that a stop interrupted: checkpointed, and run first when the run resumes (a run stopped
        #: during the evaluation after its last iteration would otherwise resume finished and never be evaluated)
        self.eval_pending = False
        self.stop_signal: str | None = None  #: SIGTERM / SIGINT when a signal stopped the run
        self._pbar = None
        self._optimizer = None
        from stepflow.sharding import same_graph_as_fsdp

        same_graph_as_fsdp(policy.transformer)  # the same backward sums under every strategy (full fine-tuning)
        from stepflow.objectives import Grpo
        from stepflow.weighting import build_weighting

        self.objective = (objective if objective is not None else Grpo()).bind(train)
        if self.objective.uses_reference:
            policy.prepare_reference()  # full fine-tuning: copy π_ref before any weight (or EMA swap) changes it
        if loop.compile:
            policy.transformer.compile(backend=loop.compile)  # in place: parameter names (LoRA, checkpoints) stay
        self.ema = ParamEMA(policy.trainable_parameters(), ema.decay, ema.update_every) if ema.enabled else None
        self.objective.attach(list(policy.trainable_parameters()))
        guidance = loop.guidance if loop.guidance is not None else getattr(policy, "guidance", 1.0)
        # weighting=auto measures every step the objective may train
        candidates = self.objective.trained_steps(train, sampler, policy.time_grid(loop.num_steps), None)
        weighting = build_weighting(train.weighting, candidates, train.auto_warmup, train.auto_every)
        self.learner = Learner(policy, reward, sampler, advantage, plan, loop, train, None,
                               guidance=float(guidance), backward=self._backward,
                               on_optimizer_step=self.ema.step if self.ema is not None else None, window=window,
                               objective=self.objective, weighting=weighting)

    # ------------------------------------------------------------------ optimizer and checkpoint state
    def configure_optimizers(self):
        params = list(self.policy.trainable_parameters())
        if not params:
            raise ValueError("lora.rank: the policy has nothing to train (a LoRA with lora.rank > 0, or model.finetune=full)")
        o = self.train_cfg
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.adam_eps)

    def configure_model(self) -> None:
        """FSDP2 (``trainer=fsdp``): shard the transformer per block, and the frozen full-fine-tuning reference the
        same way; then the EMA is rebuilt on the sharded parameters (the optimizer is built after this hook). Other
        strategies: nothing to do."""
        from stepflow.sharding import is_sharded

        strategy = self._trainer.strategy if self._trainer is not None else None
        if not hasattr(strategy, "shard") or is_sharded(self.policy.transformer):
            return
        strategy.shard(self.policy.transformer)
        ref = getattr(self.policy, "_ref_copy", None)
        if ref:
            strategy.shard(ref[0])
        if self.ema is not None:  # fully_shard replaced the parameters: track the new (sharded) ones
            self.ema = ParamEMA(self.policy.trainable_parameters(), self.ema.decay, self.ema.update_every)
            self.learner.on_optimizer_step = self.ema.step
        self.objective.attach(list(self.policy.trainable_parameters()))  # its copies too

    def _backward(self, loss: torch.Tensor) -> None:
        if self._trainer is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    def state_dict(self, *args, **kwargs):  # only the trained weights: the rest comes from the model config
        trained = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if k in trained}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["stepflow"] = {
            "iteration": self.iteration, "opt_steps": self.learner.opt_steps, "nfe_total": self.nfe_total,
            "reward_images_total": self.reward_images_total, "spent": dict(self.spent),
            "credit": self.learner.advantage.state_dict(),
            "ema": None if self.ema is None else self.ema.state_dict(), "history": self.history,
            "torch_rng": torch.get_rng_state(),
            "signal": self.learner.weighting.state_dict(), "objective": self.objective.state_dict(),
            "eval_pending": self.eval_pending,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from stepflow.checkpoint import check_compatible

        # before Lightning loads the weights and the optimizer: another model's checkpoint is one line, not a shape
        # error deep in the optimizer's state (FSDP2 / DeepSpeed load the weights themselves and hand the rest here)
        if "state_dict" in checkpoint:
            where = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
            check_compatible(checkpoint, self.state_dict(), where or "", needs=("stepflow",))
        s = checkpoint["stepflow"]
        self.iteration, self.learner.opt_steps = s["iteration"], s["opt_steps"]
        self.nfe_total, self.reward_images_total = s["nfe_total"], s["reward_images_total"]
        self.learner.advantage.load_state_dict(s["credit"])
        if self.ema is not None and s["ema"] is not None:
            self.ema.load_state_dict(s["ema"])
        self.history = list(s["history"])
        # what was spent; a checkpoint from before loop.budget: summed from its history (the same counters)
        self.spent = dict(s.get("spent") or {
            "nfe": sum(float(h.get("cost/nfe_fwd_equiv", 0.0)) for h in self.history),
            "seconds": sum(float(h.get("time/iteration_s", 0.0)) for h in self.history)})
        self.learner.weighting.load_state_dict(s.get("signal"))
        if s.get("objective"):
            self.objective.load_state_dict(s["objective"])
        self.eval_pending = bool(s.get("eval_pending", False))
        for lg in self.loggers:
            if hasattr(lg, "restore"):
                lg.restore(self.history)
        torch.set_rng_state(s["torch_rng"])

    def _log(self, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._trainer is not None and self.global_rank == 0:
            for lg in self.loggers:
                lg.log_metrics(metrics, step=self.iteration)
        self.history.append({"iteration": self.iteration, **metrics})

    # ------------------------------------------------------------------ the iteration
    def on_train_start(self) -> None:
        from stepflow import stop

        stop.reclaim()  # after the Trainer installed its own SIGTERM handler (a collective inside a signal handler)
        if self.global_rank == 0:
            from tqdm.auto import tqdm

            self._pbar = tqdm(total=self.loop.iterations, initial=self.iteration, desc="GRPO", unit="it", dynamic_ncols=True)
        if (self.iteration == 0 and self.eval_cfg.at_start) or self.eval_pending:
            self._evaluate()

    def on_train_end(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
        if self.stop_reason is None:
            state = self._gathered_trained()  # every rank: sharded weights are gathered by a collective
            if self.global_rank == 0:
                self.save_outputs(state)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.iteration >= self.loop.iterations or self.stop_reason or self._budget_spent():  # a finished run
            self.trainer.should_stop = True  # resumed, or stopping
            return None
        before = dict(self.spent)
        metrics = self._guarded(self.iterate)
        if metrics is None:
            return None
        if self._pbar is not None:
            self._pbar.update(1)
            shown = metrics.get("train/reward_final", metrics.get("train/reward_mean", float("nan")))
            self._pbar.set_postfix(reward=f"{shown:.3f}", kl=f"{metrics.get('train/kl', 0):.2e}")
        every = self.eval_cfg.every
        done = self.iteration >= self.loop.iterations or self._budget_spent()
        evaluate = bool(every and self.iteration % every == 0) or done
        if self.budget is not None:  # eval.at_fractions of the budget: after the iteration that reaches each
            from stepflow.budget import crossed

            k = self.budget.kind
            evaluate = evaluate or bool(crossed(before[k], self.spent[k], self.budget.total, self.eval_cfg.at_fractions))
            if self.iteration >= self.loop.iterations and not self._budget_spent() and self.global_rank == 0:
                import logging

                logging.getLogger("stepflow.train").warning(
                    f"loop.iterations={self.loop.iterations} reached at {self.budget.fraction(self.spent):.0%} of "
                    f"loop.budget ({self.budget}); raise loop.iterations to spend all of it")
        if evaluate:
            self._evaluate()
        # every rank decides together: a signal seen by one rank only (or by one rank earlier) must not stop it
        # alone, the others would wait in the next iteration's collectives (the budget is the same on every rank:
        # its counters are reduced over ranks)
        if Dist.from_module(self).stop_requested() and not done:
            from stepflow import stop  # a stop seen here, between iterations: the run is not finished, so
            # on_train_end must not write its final outputs (the adapter marks a finished run for every suite)
            self.stop_reason = f"stopped by {stop.reason()} after iteration {self.iteration}"
            self.stop_signal = stop.reason()
            self.trainer.should_stop = True
        if done:
            self.trainer.should_stop = True  # epochs only tick; the iteration counter (checkpointed) decides

    def _evaluate(self) -> None:
        """The held-out evaluation of this iteration; one a stop interrupts stays pending (checkpointed)."""
        self.eval_pending = True
        if self._guarded(self.run_evaluation) is not None:
            self.eval_pending = False

    def _budget_spent(self) -> bool:
        return self.budget is not None and self.spent[self.budget.kind] >= self.budget.total

    def _guarded(self, fn):
        """``fn()``, or None after a stop request or a reward service that stays down: the run then stops cleanly
        (``stop_reason``) with last.ckpt holding the last finished iteration."""
        try:
            return fn()
        except StopRequested as e:
            self.stop_reason, self.stop_signal = f"stopped by {e} after iteration {self.iteration}", str(e)
        except RewardServiceError as e:
            self.stop_reason = f"reward service failed at iteration {self.iteration}: {e}"
        if self._trainer is not None:
            self.trainer.should_stop = True
        return None

    def iterate(self) -> dict[str, float]:
        """Run one GRPO iteration (also without a Trainer); returns its metrics (also logged)."""
        learner = self.learner
        learner.dist = Dist.from_module(self)
        if learner.optimizer is None or self._trainer is not None:
            learner.optimizer = self.optimizers() if self._trainer is not None else self._own_optimizer()
        if learner.dist.manual_grad_sync:  # gradients are all-reduced by hand: DDP's reducer stays off
            model = getattr(self.trainer.strategy, "model", None)
            if model is not None and hasattr(model, "require_backward_grad_sync"):
                model.require_backward_grad_sync = False
        res = iteration(learner, self.iteration)
        if self.loop.dump_trajectories and learner.dist.rank == 0:
            d = self.run_dir / "trajectories"
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"rewards": res.rewards, "advantages": res.advantages.advantages,
                        "group_ids": res.plan.group_ids, "prompts": res.plan.prompts}, d / f"iter_{self.iteration:04d}.pt")
        m = iteration_metrics(res, learner.dist)
        self.iteration += 1
        self.nfe_total += int(m["cost/nfe"])
        self.reward_images_total += int(m["cost/reward_images"])
        m["cost/nfe_total"], m["cost/reward_images_total"] = self.nfe_total, self.reward_images_total
        # the budget's counters: identical on every rank (NFEs are summed over ranks, seconds the slowest rank's)
        self.spent["nfe"] += float(m["cost/nfe_fwd_equiv"])
        self.spent["seconds"] += learner.dist.all_max(float(m["time/iteration_s"]))
        m["cost/nfe_fwd_equiv_total"], m["cost/train_seconds_total"] = self.spent["nfe"], self.spent["seconds"]
        if self.budget is not None:
            m["budget/fraction"] = self.budget.fraction(self.spent)
        self._log(m)
        return m

    def _own_optimizer(self):
        """Standalone use without a Trainer: the module's own optimizer."""
        if self._optimizer is None:
            self._optimizer = self.configure_optimizers()
        return self._optimizer

    # ------------------------------------------------------------------ evaluation and outputs
    @torch.no_grad()
    def run_evaluation(self) -> dict[str, float]:
        """Held-out prompts, ODE sampling, EMA weights; logs eval/<reward> (+ eval/geneval*) and writes a grid."""
        from stepflow.heldout import balanced_subset, evaluate_reward, save_grid

        dist = Dist.from_module(self)  # every rank samples and scores its share of the prompts
        e = self.eval_cfg
        recs = balanced_subset(self.eval_records, e.max_prompts)
        guidance = e.guidance if e.guidance is not None else getattr(self.policy, "eval_guidance", 1.0)
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            res, images, prompts = evaluate_reward(self.policy, self.reward, recs, num_steps=e.num_steps,
                                                   guidance=float(guidance), seed=e.seed, batch_size=e.batch_size,
                                                   dist=dist)
        if dist.rank == 0:
            n = min(e.grid_prompts, len(prompts))
            save_grid(images[:n], prompts[:n], self.run_dir / "eval_grids" / f"iter_{self.iteration:04d}.png")
            self._log(res)
        return res

    def save_outputs(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """Reward-curve PNG and the (EMA) adapter in diffusers format (``state``: gathered from shards)."""
        from stepflow.plots import plot_curves

        plot_curves(self.history, self.run_dir / "reward_curve.png")
        self.save_trained(self.run_dir / self.policy.trained_subdir, state)

    def _gathered_trained(self) -> dict[str, torch.Tensor] | None:
        """FSDP2: the (EMA) trained weights gathered whole on rank 0 (every rank must call it); None unsharded."""
        from stepflow.sharding import full_trained_state, is_sharded

        if not is_sharded(self.policy.transformer):
            return None
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            return full_trained_state(self.policy, self.policy.finetune == "full")

    def save_trained(self, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the (EMA) trained weights in diffusers format: the LoRA (``pipe.load_lora_weights(dir)``), or the
        fully fine-tuned transformer (``transformer.save_pretrained``). ``state``: the weights gathered from FSDP2
        shards (:meth:`_gathered_trained`, EMA already applied), written instead of the live ones."""
        if state is not None:
            return self.policy.save_trained(out_dir, state_dict=state)
        with self.ema.applied() if self.ema is not None else contextlib.nullcontext():
            return self.policy.save_trained(out_dir)
