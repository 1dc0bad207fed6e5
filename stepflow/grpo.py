"""GRPOModule: one LightningModule epoch is one GRPO iteration of the paper's algorithm (method.md §10).

    plan prompts ─► rollout (SDE, π_old, no grad) ─► x̂0 estimates (T′ substeps, batched over steps)
                 ─► rewards R_0..R_T (one reward call) ─► advantages (credit scheme, gathered across ranks)
                 ─► policy update over the trainable steps (clipped GRPO + β·KL to the LoRA-disabled reference)

Manual optimization. Uniform credit (Flow-GRPO) only scores the final image. ``advantage=distill`` rolls out with the
ODE and regresses the student's Tweedie estimate onto a two-step-later target, weighted by the gain advantages.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from stepflow.credit import CreditAssigner, CreditConfig
from stepflow.data import GroupSampler
from stepflow.loss import distill_loss, policy_loss
from stepflow.policies.base import FlowPolicy
from stepflow.rewards.base import Reward
from stepflow.rollout import Trajectory, estimate_states, rollout, score_final, score_states
from stepflow.sde import SamplerConfig, sde_step


def _check_fields(cls, values: dict, prefix: str) -> dict:
    names = {f.name for f in fields(cls)}
    bad = [k for k in values if k not in names]
    if bad:
        raise ValueError(f"{prefix}.{bad[0]}: unknown field; valid fields: {', '.join(sorted(names))}")
    return values


@dataclass
class OptimConfig:
    """Policy-update settings (Flow-GRPO's defaults, method.md §7.1)."""

    lr: float = 3e-4  #: AdamW learning rate
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    adam_eps: float = 1e-8
    clip_eps: float = 1e-4  #: PPO clip range ϵ (per-dim-mean log-prob convention)
    beta_kl: float = 0.0  #: β, weight of the KL to the LoRA-disabled reference
    kl_mode: str = "exact"  #: exact | flow_grpo_parity
    max_grad_norm: float = 1.0  #: gradient clipping (0 = off)
    train_steps: list[int] | None = None  #: step indices to train; None = every step with std > 0
    timestep_fraction: float = 1.0  #: train only the first int(T·fraction) steps (Flow-GRPO: 0.99 → 9 of 10)
    micro_batch_size: int = 32  #: samples per forward/backward
    updates_per_iter: int = 1  #: optimizer steps per rollout batch (1 = on-policy; Flow-GRPO uses 2)
    on_policy: bool = False  #: force one optimizer step per rollout (ratio = 1: the KL-regularised policy gradient)
    drop_zero_adv: bool = True  #: skip samples whose advantages are 0 at every step
    distill_weight: str = "relu"  #: distill only: relu | signed | exp
    distill_temperature: float = 1.0

    def __post_init__(self):
        if self.kl_mode not in ("exact", "flow_grpo_parity"):
            raise ValueError(f"kl_mode: must be exact or flow_grpo_parity, got {self.kl_mode!r}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if self.clip_eps <= 0:
            raise ValueError(f"clip_eps: must be > 0, got {self.clip_eps}")
        if self.beta_kl < 0:
            raise ValueError(f"beta_kl: must be >= 0, got {self.beta_kl}")
        if not 0 < self.timestep_fraction <= 1:
            raise ValueError(f"timestep_fraction: must be in (0, 1], got {self.timestep_fraction}")
        if self.micro_batch_size < 1 or self.updates_per_iter < 1:
            raise ValueError("micro_batch_size / updates_per_iter: must be >= 1")
        self.betas = tuple(self.betas)
        if self.on_policy:
            self.updates_per_iter = 1


@dataclass
class LoopConfig:
    """Everything of an iteration that is not the optimizer, the sampler or the credit scheme."""

    iterations: int = 40  #: GRPO iterations (= Lightning epochs)
    prompts_per_iter: int = 8  #: P prompts per iteration (global, over all ranks)
    group_size: int = 8  #: k samples per prompt
    num_steps: int = 10  #: denoising steps T
    guidance: float = 1.0  #: CFG scale during rollout and update (1 = no CFG)
    same_latent: bool = True  #: share x_T within a group (method.md §4)
    substeps: int = 5  #: T′, Euler substeps of the x̂0 estimate (1 = Tweedie)
    adaptive_substeps: bool = False  #: ceil(T′·t) substeps per state
    estimate_chunk: int | None = None  #: max states per estimate call (memory)
    decode_chunk: int | None = None  #: max latents per VAE decode call
    seed: int = 0
    dump_trajectories: bool = False  #: write rewards/advantages of every iteration to <run>/trajectories/ (debug)


@dataclass
class EvalConfig:
    every: int = 10  #: evaluate every N iterations (and at start and end); 0 = only start and end
    num_steps: int = 10  #: ODE steps
    guidance: float = 1.0
    max_prompts: int | None = None  #: subset of the held-out prompts (None = all)
    seed: int = 1234
    batch_size: int = 128
    grid_prompts: int = 24  #: samples in the image grid


@dataclass
class EmaConfig:
    enabled: bool = True  #: EMA of the LoRA weights, used for evaluation and saved adapters
    decay: float = 0.9
    update_every: int = 1  #: optimizer steps between EMA updates (Flow-GRPO: 8 with many steps per epoch)


class LoraEMA:
    """EMA of a list of parameters with Flow-GRPO's warm-up: decay_n = min((1+n)/(10+n), decay)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, update_every: int = 1):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]
        self.decay, self.update_every, self.num_updates = decay, update_every, 0
        self._backup: list[Tensor] | None = None

    @torch.no_grad()
    def step(self, opt_step: int) -> None:
        if (opt_step + 1) % self.update_every:
            return
        d = min((1 + self.num_updates) / (10 + self.num_updates), self.decay)
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(p.detach(), alpha=1 - d)
        self.num_updates += 1

    @torch.no_grad()
    def swap_in(self) -> None:
        self._backup = [p.detach().clone() for p in self.params]
        for s, p in zip(self.shadow, self.params):
            p.copy_(s)

    @torch.no_grad()
    def swap_out(self) -> None:
        assert self._backup is not None
        for b, p in zip(self._backup, self.params):
            p.copy_(b)
        self._backup = None

    def state_dict(self) -> dict:
        return {"shadow": [s.clone() for s in self.shadow], "num_updates": self.num_updates}

    def load_state_dict(self, sd: dict) -> None:
        for s, v in zip(self.shadow, sd["shadow"]):
            s.copy_(v)
        self.num_updates = int(sd["num_updates"])


def rollout_sampler(sampler: SamplerConfig, credit: CreditConfig) -> SamplerConfig:
    """The sampler the rollouts use: the configured one, or the ODE for ``advantage=distill`` (method.md §6.3)."""
    return SamplerConfig(name="ode") if credit.scheme == "distill" else sampler


class GRPOModule(L.LightningModule):
    """Stepwise-Flow-GRPO / Flow-GRPO training as a LightningModule (manual optimization).

    Args:
        policy: a FlowPolicy with a LoRA adapter added (its LoRA weights are the only trainable parameters).
        reward: the training reward.
        sampler: rollout SDE (``stepflow.sde.SamplerConfig``).
        credit: advantage scheme (``stepflow.credit.CreditConfig``).
        sampler_plan: the group sampler over the training prompts.
        eval_records: held-out prompt records for evaluation.
        loop / optim / eval_cfg / ema: the dataclass configs above.
        run_dir: where grids and plots go.
    """

    def __init__(self, policy: FlowPolicy, reward: Reward, sampler: SamplerConfig, credit: CreditConfig,
                 sampler_plan: GroupSampler, eval_records: list[dict], loop: LoopConfig, optim: OptimConfig,
                 eval_cfg: EvalConfig, ema: EmaConfig, run_dir: str | Path = ".", write_csv: bool = True):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold only the LoRA weights
        self.policy, self.reward = policy, reward
        self.sampler_cfg, self.credit_cfg = rollout_sampler(sampler, credit), credit
        self.loop, self.optim_cfg, self.eval_cfg, self.ema_cfg = loop, optim, eval_cfg, ema
        self.distill = credit.scheme == "distill"
        if self.distill:  # method.md §6.3: diversity from the initial noise
            sampler_plan.same_latent = False
        self.plan = sampler_plan
        self.eval_records = eval_records
        self.credit = CreditAssigner(credit)
        self.run_dir = Path(run_dir)
        self.iteration = 0
        self.opt_steps = 0
        self.nfe_total = 0
        self.reward_images_total = 0
        self.lora_ema = LoraEMA(self.policy.lora_parameters(), ema.decay, ema.update_every) if ema.enabled else None
        self.history: list[dict[str, float]] = []
        self._pbar = None
        self.stop_reason: str | None = None
        self.csv = MetricsCSV(self.run_dir / "metrics.csv") if write_csv else None

    # ------------------------------------------------------------------ Lightning plumbing
    def configure_optimizers(self):
        params = list(self.policy.lora_parameters())
        if not params:
            raise ValueError("model.lora: the policy has no trainable LoRA parameters (lora.rank must be > 0)")
        o = self.optim_cfg
        return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, eps=o.adam_eps)

    def state_dict(self, *args, **kwargs):  # only the adapter: base weights come from the model config
        full = super().state_dict(*args, **kwargs)
        return {k: v for k, v in full.items() if "lora_" in k}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["stepflow"] = {
            "iteration": self.iteration, "opt_steps": self.opt_steps, "nfe_total": self.nfe_total,
            "reward_images_total": self.reward_images_total, "credit": self.credit.state_dict(),
            "ema": None if self.lora_ema is None else self.lora_ema.state_dict(), "history": self.history,
            "torch_rng": torch.get_rng_state(),
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        s = checkpoint["stepflow"]
        self.iteration, self.opt_steps = s["iteration"], s["opt_steps"]
        self.nfe_total, self.reward_images_total = s["nfe_total"], s["reward_images_total"]
        self.credit.load_state_dict(s["credit"])
        if self.lora_ema is not None and s["ema"] is not None:
            self.lora_ema.load_state_dict(s["ema"])
        self.history = list(s["history"])
        torch.set_rng_state(s["torch_rng"])

    def _optimizer(self):
        """The Lightning-managed optimizer, or (standalone use without a Trainer) our own."""
        if self._trainer is not None:
            return self.optimizers()
        if getattr(self, "_standalone_opt", None) is None:
            self._standalone_opt = self.configure_optimizers()
        return self._standalone_opt

    def _backward(self, loss: Tensor) -> None:
        if self._trainer is not None:
            self.manual_backward(loss)
        else:
            loss.backward()

    def _all_sum(self, x: float) -> float:
        t = torch.tensor([x], device=self.device)
        torch.distributed.all_reduce(t)
        return float(t)

    def _all_reduce_grads(self) -> None:
        """Sum the LoRA gradients over ranks (each rank's loss terms are already weighted by the global row count;
        DDP's own reducer is off because we call backward many times per optimizer step)."""
        for p in self.policy.lora_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch.distributed.all_reduce(p.grad)

    def _manual_grad_sync(self) -> bool:
        """True under DDP, where we all-reduce LoRA gradients ourselves; sharded strategies (FSDP, DeepSpeed) reduce
        their own gradients in backward."""
        if self._trainer is None or self.trainer.world_size == 1:
            return False
        from lightning.pytorch.strategies import DDPStrategy

        return isinstance(self.trainer.strategy, DDPStrategy)

    def _disable_ddp_sync(self) -> None:
        model = getattr(self.trainer.strategy, "model", None)
        if model is not None and hasattr(model, "require_backward_grad_sync"):
            model.require_backward_grad_sync = False

    def _world(self) -> tuple[int, int]:
        if self._trainer is None:
            return 0, 1
        return self.global_rank, self.trainer.world_size

    def _log(self, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        if self._trainer is not None and self.global_rank == 0:
            for lg in self.loggers:  # tensorboard / wandb
                lg.log_metrics(metrics, step=self.iteration)
        self.history.append({"iteration": self.iteration, **metrics})
        if self.csv is not None and (self._trainer is None or self.global_rank == 0):
            self.csv.write(self.history)

    # ------------------------------------------------------------------ the iteration
    def on_train_start(self) -> None:
        if self.global_rank == 0:
            from tqdm.auto import tqdm

            self._pbar = tqdm(total=self.loop.iterations, initial=self.iteration, desc="GRPO", unit="it", dynamic_ncols=True)
        if self.iteration == 0:
            self.run_evaluation()

    def on_train_end(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
        if self.global_rank == 0 and self.stop_reason is None:
            self.save_outputs()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        if self.iteration >= self.loop.iterations:  # e.g. resuming a finished run
            self.trainer.should_stop = True
            return None
        if self._manual_grad_sync():
            self._disable_ddp_sync()  # gradients are all-reduced by hand in update()
        try:
            metrics = self.iterate()
        except Exception as e:  # a remote reward that stays down: stop cleanly, last.ckpt stays usable
            from stepflow.rewards.errors import RewardServiceError

            if not isinstance(e, RewardServiceError):
                raise
            self.stop_reason = f"reward service failed at iteration {self.iteration}: {e}; resume with ckpt_path=<run dir>/checkpoints/last.ckpt"
            self.trainer.should_stop = True
            return None
        if self._pbar is not None:
            self._pbar.update(1)
            self._pbar.set_postfix(reward=f"{metrics['train/reward_final']:.3f}", kl=f"{metrics.get('train/kl', 0):.2e}")
        every = self.eval_cfg.every
        if (every and self.iteration % every == 0) or self.iteration == self.loop.iterations:
            self.run_evaluation()
        if self.iteration >= self.loop.iterations:
            self.trainer.should_stop = True  # epochs only tick; the iteration counter (checkpointed) decides

    def gather_rows(self, x: Tensor) -> Tensor:
        """All ranks' rows in rank order: (B_local, ...) -> (B_global, ...)."""
        rank, world = self._world()
        if world == 1:
            return x
        g = self.all_gather(x.to(self.device))
        return g.flatten(0, 1).cpu()

    def iterate(self) -> dict[str, float]:
        """Run one GRPO iteration; returns its metrics (also logged)."""
        rank, world = self._world()
        lp, pol = self.loop, self.policy
        full_plan = self.plan.plan(self.iteration)
        plan = full_plan.shard(rank, world)
        t_steps = lp.num_steps
        m: dict[str, float] = {}

        t0 = time.perf_counter()
        pol.eval()
        cond = pol.encode(plan.prompts)
        traj, nfe_roll = rollout(pol, cond, plan.prompts, plan.meta, plan.group_ids, self.sampler_cfg, t_steps,
                                 lp.guidance, plan.latent_seeds, plan.sample_seeds)
        t1 = time.perf_counter()
        nfe_est = 0
        if self.credit.needs_stepwise_rewards:
            x0_hat, nfe_est = estimate_states(pol, traj, lp.substeps, lp.guidance, lp.adaptive_substeps, lp.estimate_chunk)
            traj.x0_hat = x0_hat
            t2 = time.perf_counter()
            rewards, comps = score_states(pol, self.reward, traj, x0_hat, lp.decode_chunk)
            n_images = traj.batch_size * (t_steps + 1)
        else:
            t2 = time.perf_counter()
            rewards, comps = score_final(pol, self.reward, traj)
            n_images = traj.batch_size
        traj.rewards, traj.reward_components = rewards, comps
        t3 = time.perf_counter()

        all_rewards = self.gather_rows(rewards)
        credit_out = self.credit(all_rewards, full_plan.group_ids, t_steps)
        per = traj.batch_size
        adv = credit_out.advantages[rank * per:(rank + 1) * per]

        if lp.dump_trajectories and rank == 0:
            d = self.run_dir / "trajectories"
            d.mkdir(parents=True, exist_ok=True)
            torch.save({"rewards": all_rewards, "advantages": credit_out.advantages, "group_ids": full_plan.group_ids,
                        "prompts": full_plan.prompts}, d / f"iter_{self.iteration:04d}.pt")
        upd = self.update(traj, adv)
        t4 = time.perf_counter()

        nfe = nfe_roll + nfe_est + upd.pop("nfe")
        self.nfe_total += nfe * world
        self.reward_images_total += n_images * world
        self.iteration += 1

        final = all_rewards[:, -1]
        m["train/reward_final"] = final.mean().item()
        m["train/reward_std"] = final.std().item() if final.numel() > 1 else 0.0
        if self.credit.needs_stepwise_rewards:
            m["train/reward_mean"] = all_rewards.mean().item()
            for k in range(t_steps + 1):
                m[f"train/reward_step{k}"] = all_rewards[:, k].mean().item()
        else:
            m["train/reward_mean"] = final.mean().item()
        for name, v in comps.items():
            m[f"train/{name}"] = (v[:, -1] if v.ndim == 2 else v).float().mean().item()
        m.update({f"train/{k}": float(v) for k, v in credit_out.stats.items()})
        m.update(upd)
        m.update({"time/rollout_s": t1 - t0, "time/estimate_s": t2 - t1, "time/reward_s": t3 - t2,
                  "time/update_s": t4 - t3, "time/iteration_s": t4 - t0,
                  "cost/nfe": nfe * world, "cost/nfe_rollout": nfe_roll * world, "cost/nfe_estimate": nfe_est * world,
                  "cost/nfe_total": self.nfe_total, "cost/reward_calls": 1, "cost/reward_images": n_images * world,
                  "cost/reward_images_total": self.reward_images_total})
        self._log(m)
        return m

    # ------------------------------------------------------------------ update
    def trainable_steps(self, traj: Trajectory) -> list[int]:
        """Steps to train: ``train_steps`` or the first int(T·timestep_fraction) steps, minus steps with std 0."""
        t_steps = traj.num_steps
        o = self.optim_cfg
        cand = list(o.train_steps) if o.train_steps is not None else list(range(int(t_steps * o.timestep_fraction + 1e-9)))
        if self.distill:
            return [k for k in cand if 0 <= k < t_steps]
        return [k for k in cand if 0 <= k < t_steps and bool(traj.trainable[:, k].all())]

    def update(self, traj: Trajectory, adv: Tensor) -> dict[str, float]:
        """Policy update over the trainable steps; ``updates_per_iter`` optimizer steps, each accumulating over
        (trainable steps × micro-batches). Returns diagnostics (mean over terms) incl. per-step clip fraction."""
        opt = self._optimizer()
        o, lp, pol = self.optim_cfg, self.loop, self.policy
        steps = self.trainable_steps(traj)
        b = traj.batch_size
        keep = torch.ones(b, dtype=torch.bool)
        if o.drop_zero_adv and not self.distill:
            keep = adv.abs().sum(1) > 0
        rows = torch.nonzero(keep).flatten()
        gen = torch.Generator().manual_seed(self.loop.seed * 7919 + self.iteration)
        rows = rows[torch.randperm(len(rows), generator=gen)]
        chunks = [c for c in rows.chunk(o.updates_per_iter) if len(c)] if len(rows) else []
        times = traj.times.to(self.device)
        stats: dict[str, list[float]] = {}
        nfe = 0
        rank, world = self._world()
        if world > 1:  # the same number of optimizer steps on every rank (a rank may hold no rows of a chunk)
            chunks = list(rows.tensor_split(o.updates_per_iter))
        if not steps:  # e.g. the ODE sampler: no step has a density, nothing to train
            chunks = []
        pol.train()
        for chunk in chunks:
            n_global = self._all_sum(float(len(chunk))) if world > 1 else float(len(chunk))
            if n_global == 0:
                continue
            opt.zero_grad(set_to_none=True)
            mbs = [mb for mb in chunk.split(o.micro_batch_size) if len(mb)]
            for k in steps:
                for mb in mbs:
                    out = self._loss_term(traj, adv, k, mb, times)
                    # each term is a mean over its rows: weight it so the step's loss is the mean over all rows of
                    # the chunk on all ranks (gradients are then summed over ranks), averaged over the steps
                    self._backward(out["loss"] * (len(mb) / (n_global * len(steps))))
                    nfe += len(mb) * (2 if lp.guidance != 1.0 else 1) * (2 if (o.beta_kl > 0 and not self.distill) else 1)
                    for name, v in out.items():
                        if name != "loss":
                            stats.setdefault(name, []).append(float(v))
                            if name in ("clip_frac", "kl"):
                                stats.setdefault(f"{name}_step{k}", []).append(float(v))
            if self._manual_grad_sync():
                self._all_reduce_grads()
            if o.max_grad_norm > 0:
                gn = torch.nn.utils.clip_grad_norm_(list(pol.lora_parameters()), o.max_grad_norm)
                stats.setdefault("grad_norm", []).append(float(gn))
            opt.step()
            self.opt_steps += 1
            if self.lora_ema is not None:
                self.lora_ema.step(self.opt_steps - 1)
        pol.eval()
        res = {f"train/{k}": sum(v) / len(v) for k, v in stats.items()}
        if "train/ratio_min" in res:
            res["train/ratio_min"] = min(stats["ratio_min"])
            res["train/ratio_max"] = max(stats["ratio_max"])
        res["train/samples_trained"] = float(len(rows))
        res["train/steps_trained"] = float(len(steps))
        res["nfe"] = nfe
        return res

    def _loss_term(self, traj: Trajectory, adv: Tensor, k: int, mb: Tensor, times: Tensor) -> dict[str, Any]:
        o, lp, pol = self.optim_cfg, self.loop, self.policy
        dev = self.device
        x_k = traj.latents[mb, k].to(dev)
        cond = traj.cond.index(mb).to(dev)
        t, t_next = times[k], times[k + 1]
        v = pol.velocity(x_k, t, cond, lp.guidance)
        a = adv[mb, k].to(dev)
        if self.distill:
            # method.md §6.3: student Tweedie at (x_t, t) vs sg[x̂0 two steps later] (X_T beyond the end)
            student = x_k - t * v
            target = traj.x0_hat[mb, min(k + 2, traj.num_steps)].to(dev)
            loss = distill_loss(student, target, a, weight=o.distill_weight, temperature=o.distill_temperature)
            return {"loss": loss, "distill_loss": loss.detach()}
        x_next = traj.latents[mb, k + 1].to(dev)
        out = sde_step(self.sampler_cfg, x_k, v, t, t_next, t_guard=times[1], prev_sample=x_next)
        ref_mean = None
        if o.beta_kl > 0:
            with torch.no_grad(), pol.disable_adapter():
                v_ref = pol.velocity(x_k, t, cond, lp.guidance)
                ref_mean = sde_step(self.sampler_cfg, x_k, v_ref, t, t_next, t_guard=times[1], prev_sample=x_next).mean
        lo = policy_loss(out.log_prob, traj.log_probs[mb, k].to(dev), a, clip_eps=o.clip_eps, mean=out.mean,
                         ref_mean=ref_mean, std=out.std, kl_scale=out.kl_scale, beta=o.beta_kl, kl_mode=o.kl_mode)
        return {"loss": lo.loss, "policy_loss": lo.policy_loss.detach(), "kl": _f(lo.kl), "clip_frac": _f(lo.clip_frac),
                "ratio_mean": _f(lo.ratio_mean), "ratio_min": _f(lo.ratio_min), "ratio_max": _f(lo.ratio_max),
                "adv_abs": a.abs().mean().detach()}

    # ------------------------------------------------------------------ evaluation and outputs
    @torch.no_grad()
    def run_evaluation(self) -> dict[str, float]:
        """Held-out prompts, ODE sampling, EMA weights; logs eval/<reward> (+ eval/geneval*) and writes a grid."""
        rank, _ = self._world()
        res: dict[str, float] = {}
        if rank == 0:
            from stepflow.evaluation import sample_ode, save_grid

            e = self.eval_cfg
            recs = spread_subset(self.eval_records, e.max_prompts)
            prompts = [r["prompt"] for r in recs]
            if self.lora_ema is not None:
                self.lora_ema.swap_in()
            try:
                images = sample_ode(self.policy, prompts, num_steps=e.num_steps, guidance=e.guidance, seed=e.seed,
                                    batch_size=e.batch_size)
            finally:
                if self.lora_ema is not None:
                    self.lora_ema.swap_out()
            out = self.reward(images, prompts, recs)
            res[f"eval/{self.reward.name}"] = out.scores.mean().item()
            table = eval_table(self.reward, images, prompts)
            res.update({f"eval/{k}": v for k, v in table.items()})
            grid_dir = self.run_dir / "eval_grids"
            grid_dir.mkdir(parents=True, exist_ok=True)
            n = min(e.grid_prompts, len(prompts))
            save_grid(images[:n], prompts[:n], grid_dir / f"iter_{self.iteration:04d}.png")
            self._log(res)
        if self._trainer is not None and self.trainer.world_size > 1:
            self.trainer.strategy.barrier()
        return res

    def save_outputs(self) -> None:
        """Reward-curve PNG and the (EMA) LoRA adapter in diffusers format."""
        from stepflow.plots import plot_curves

        plot_curves(self.history, self.run_dir / "reward_curve.png")
        self.save_lora(self.run_dir / "lora")

    def save_lora(self, out_dir: str | Path) -> Path:
        """Write the (EMA) adapter with diffusers' ``save_lora_weights`` (loads with ``load_lora_weights``)."""
        if self.lora_ema is not None:
            self.lora_ema.swap_in()
        try:
            return self.policy.save_lora(out_dir)
        finally:
            if self.lora_ema is not None:
                self.lora_ema.swap_out()


class MetricsCSV:
    """``metrics.csv`` from the run's metric rows: appends while the columns are unchanged, rewrites (atomically)
    when a new column appears or after a resume (the history restored from the checkpoint is the truth)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.columns: list[str] | None = None
        self.rows_written = 0

    def write(self, history: Sequence[dict[str, float]]) -> None:
        import csv

        cols = ["iteration"] + sorted({k for h in history for k in h if k != "iteration"})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if cols == self.columns and self.rows_written <= len(history):
            with self.path.open("a", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=cols)
                for h in history[self.rows_written:]:
                    w.writerow(h)
        else:
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=cols)
                w.writeheader()
                w.writerows(history)
            tmp.replace(self.path)
            self.columns = cols
        self.rows_written = len(history)


def spread_subset(records: list[dict], n: int | None) -> list[dict]:
    """``n`` records evenly spaced over the list (covers every category of a grouped file); all when n is None."""
    if not n or n >= len(records):
        return list(records)
    step = len(records) / n
    return [records[int(i * step)] for i in range(n)]


def _f(x) -> float:
    return float(x.detach()) if isinstance(x, Tensor) else float(x)


def eval_table(reward: Reward, images: Tensor, prompts: list[str]) -> dict[str, float]:
    """A GenEval-style per-category table when the reward knows one (the embedded world), else {}."""
    fn = getattr(reward, "geneval_table", None)
    if fn is None:
        try:
            from stepflow.rewards.shapes_geneval import ShapesGenEvalReward, geneval_table

            if isinstance(reward, ShapesGenEvalReward):
                fn = geneval_table
        except ImportError:
            fn = None
    return {} if fn is None else {k: float(v) for k, v in fn(images, prompts).items()}
