"""GRPOModule: the Lightning shell around :func:`stepflow.core.algorithm.iteration` (one epoch = one GRPO iteration).

The algorithm itself is Lightning-free (``stepflow/core/algorithm.py``). This module owns what Lightning is for: the
optimizer, manual optimization under DDP / FSDP / DeepSpeed, checkpoint state (iteration counters, EMA, the
advantage estimator's state, the metric history, the RNG), logging, and the evaluation schedule (held-out prompts,
ODE sampling with the EMA weights, at the start, every ``eval.every`` iterations and at the end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch

from stepflow.config import EmaConfig, EvalConfig, LoopConfig, TrainConfig
from stepflow.core import stop
from stepflow.core.algorithm import Learner, iteration, iteration_metrics
from stepflow.core.budget import parse_budget
from stepflow.core.data import PromptPlanner
from stepflow.core.dist import Dist
from stepflow.core.ema import ParamEMA
from stepflow.errors import RewardServiceError, StopRequested
from stepflow.math.weighting import build_weighting
from stepflow.objectives import Grpo
from stepflow.policies.base import FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.shell import outputs, run_state
from stepflow.shell.progress import Progress
from stepflow.shell.sharding import same_graph_as_fsdp, shard_module

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
        self.budget = parse_budget(loop.budget)  #: loop.budget (None: loop.iterations decides)
        #: what the iterations spent (stepflow.core.budget): forward-equivalent NFEs over ranks, training seconds
        self.spent = {"nfe": 0.0, "seconds": 0.0}
        self.history: list[dict[str, float]] = []
        self.stop_reason: str | None = None
        #: an evaluation that a stop interrupted: checkpointed, and run first when the run resumes (a run stopped
        #: during the evaluation after its last iteration would otherwise resume finished and never be evaluated)
        self.eval_pending = False
        self.stop_signal: str | None = None  #: SIGTERM / SIGINT when a signal stopped the run
        self._pbar = None
        self._optimizer = None
        same_graph_as_fsdp(policy.transformer)  # the same backward sums under every strategy (full fine-tuning)
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
        """FSDP2: shard the policy (:func:`stepflow.shell.sharding.shard_module`); other strategies: nothing."""
        shard_module(self, self._trainer.strategy if self._trainer is not None else None)

    def _backward(self, loss: torch.Tensor) -> None:
        if self._trainer is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    def state_dict(self, *args, **kwargs):  # only the trained weights: the rest comes from the model config
        trained = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if k in trained}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["stepflow"] = run_state.save(self)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from stepflow.shell.checkpoint import check_compatible

        # before Lightning loads the weights and the optimizer: another model's checkpoint is one line, not a shape
        # error deep in the optimizer's state (FSDP2 / DeepSpeed load the weights themselves and hand the rest here)
        if "state_dict" in checkpoint:
            where = getattr(self._trainer, "ckpt_path", None) if self._trainer is not None else None
            check_compatible(checkpoint, self.state_dict(), where or "", needs=("stepflow",))
        run_state.load(self, checkpoint["stepflow"])

    def _log(self, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._trainer is not None and self.global_rank == 0:
            for lg in self.loggers:
                lg.log_metrics(metrics, step=self.iteration)
        self.history.append({"iteration": self.iteration, **metrics})

    # ------------------------------------------------------------------ the iteration
    def on_train_start(self) -> None:
        stop.reclaim()  # after the Trainer installed its own SIGTERM handler (a collective inside a signal handler)
        run_state.check_resume_trains(self)
        if self.global_rank == 0:
            self._pbar = Progress(self)
        if (self.iteration == 0 and self.eval_cfg.at_start) or self.eval_pending:
            self._evaluate()

    def on_train_end(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
        if self.stop_reason is None:
            state = outputs.gathered_trained(self)  # every rank: sharded weights are gathered by a collective
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
        every = self.eval_cfg.every
        done = self.iteration >= self.loop.iterations or self._budget_spent()
        if self._pbar is not None:
            self._pbar.advance(metrics, done)
        evaluate = bool(every and self.iteration % every == 0) or done
        if self.budget is not None:  # eval.at_fractions of the budget: after the iteration that reaches each
            evaluate = evaluate or self.budget.reaches(before, self.spent, self.eval_cfg.at_fractions)
            if self.iteration >= self.loop.iterations and not self._budget_spent() and self.global_rank == 0:
                self.budget.warn_capped(self.loop.iterations, self.spent)
        if evaluate:
            self._evaluate()
        # every rank decides together: a signal seen by one rank only (or by one rank earlier) must not stop it
        # alone, the others would wait in the next iteration's collectives (the budget is the same on every rank:
        # its counters are reduced over ranks)
        if Dist.from_module(self).stop_requested() and not done:
            # a stop seen here, between iterations: the run is not finished, so on_train_end must not write its
            # final outputs (the adapter marks a finished run for every suite)
            self.stop_reason = f"stopped by {stop.reason()} after iteration {self.iteration}"
            self.stop_signal = stop.reason()
            self.trainer.should_stop = True
        if done:
            self.trainer.should_stop = True  # epochs only tick; the iteration counter (checkpointed) decides

    def _evaluate(self) -> None:
        """The held-out evaluation of this iteration; one a stop interrupts stays pending (checkpointed)."""
        self.eval_pending = True
        res = self._guarded(self.run_evaluation)
        if res is not None:
            self.eval_pending = False
            if self._pbar is not None:
                self._pbar.evaluated(res)

    def _budget_spent(self) -> bool:
        return self.budget is not None and self.budget.spent_all(self.spent)

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
        run_state.count(self, m, learner.dist)
        self._log(m)
        return m

    def _own_optimizer(self):
        """Standalone use without a Trainer: the module's own optimizer."""
        if self._optimizer is None:
            self._optimizer = self.configure_optimizers()
        return self._optimizer

    # ------------------------------------------------------------------ evaluation and outputs
    def run_evaluation(self) -> dict[str, float]:
        """Held-out prompts, ODE sampling, EMA weights; logs eval/<reward> (+ eval/geneval*) and writes a grid."""
        return outputs.run_evaluation(self, Dist.from_module(self))

    def save_outputs(self, state: dict[str, torch.Tensor] | None = None) -> None:
        """Reward-curve PNG and the (EMA) adapter in diffusers format (``state``: gathered from shards)."""
        from stepflow.shell.plots import plot_curves

        plot_curves(self.history, self.run_dir / "reward_curve.png")
        self.save_trained(self.run_dir / self.policy.trained_subdir, state)

    def save_trained(self, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """The (EMA) trained weights in diffusers format (:func:`stepflow.shell.outputs.save_trained`)."""
        return outputs.save_trained(self, out_dir, state)
