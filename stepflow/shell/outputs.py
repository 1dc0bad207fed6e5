"""A run's held-out evaluation and its outputs (the reward curve and the trained weights in diffusers format), for
:class:`stepflow.grpo.GRPOModule`."""

from __future__ import annotations

import contextlib
import textwrap
from pathlib import Path

import torch


def ema_applied(module):
    """A context with the EMA weights in place (no EMA: nothing)."""
    return module.ema.applied() if module.ema is not None else contextlib.nullcontext()


@torch.no_grad()
def run_evaluation(module, dist) -> dict[str, float]:
    """Held-out prompts, ODE sampling, EMA weights, every rank its share; rank 0 logs eval/<reward> (+
    eval/geneval*) and writes a grid. Returns the metrics."""
    from stepflow.core.heldout import balanced_subset, evaluate_reward

    e, policy = module.eval_cfg, module.policy
    recs = balanced_subset(module.eval_records, e.max_prompts)
    guidance = e.guidance if e.guidance is not None else getattr(policy, "eval_guidance", 1.0)
    detail: dict = {}
    with ema_applied(module):
        res, images, prompts = evaluate_reward(policy, module.reward, recs, num_steps=e.num_steps,
                                               guidance=float(guidance), seed=e.seed, batch_size=e.batch_size,
                                               dist=dist, detail=detail)
    if dist.rank == 0:
        save_eval_grid(module, images, prompts, detail, res)
        module._log(res)
    return res


def save_eval_grid(module, images: torch.Tensor, prompts: list[str], detail: dict, res: dict[str, float]) -> Path | None:
    """``<run>/eval_grids/iter_NNNN.png``: ``eval.grid_prompts`` of the evaluated samples, the prompt categories
    taken in turn (videos: a strip of frames each, and ``iter_NNNN_<j>.gif`` per shown video); framed green / red by the reward's strict verdict (GenEval's rules) where it gives one, else
    captioned with the score; the title names the iteration, the held-out score and what the verdict means."""
    from stepflow.core.heldout import balanced_indices, save_grid

    n = min(module.eval_cfg.grid_prompts, len(prompts))
    if n == 0:
        return None
    idx = balanced_indices(detail.get("records") or [{"prompt": p} for p in prompts], n)
    strict, scores = detail.get("strict"), detail.get("scores")
    passed = [strict[i] for i in idx] if strict is not None else None
    name = module.reward.name
    score = res.get("eval/geneval", res.get(f"eval/{name}", float("nan")))
    what = "GenEval" if "eval/geneval" in res else name
    head = (f"held-out samples after iteration {module.iteration}" if module.iteration else "held-out samples before training")
    title = f"{head} (EMA weights): {what} {score:.3f}"
    if passed is not None:
        title += (f"; {sum(passed)}/{n} shown pass. Green: GenEval's rules pass the image, red: they do not "
                  "(the rules accept objects beyond the asked ones)")
    path = module.run_dir / "eval_grids" / f"iter_{module.iteration:04d}.png"
    if images.ndim == 5:  # videos: the grid shows frame strips; each shown video also as a GIF beside it
        from stepflow.core.heldout import save_gif

        for j, i in enumerate(idx):
            save_gif(images[i], path.with_name(f"{path.stem}_{j}.gif"))
    return save_grid(images[idx], [prompts[i] for i in idx], path,
                     title="\n".join(textwrap.wrap(title, 120)), passed=passed,
                     scores=None if passed is not None or scores is None else [scores[i] for i in idx])


def gathered_trained(module) -> dict[str, torch.Tensor] | None:
    """FSDP2: the (EMA) trained weights gathered whole on rank 0 (every rank must call it); None unsharded."""
    from stepflow.shell.sharding import full_trained_state, is_sharded

    if not is_sharded(module.policy.transformer):
        return None
    with ema_applied(module):
        return full_trained_state(module.policy, module.policy.finetune == "full")


def save_trained(module, out_dir: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the (EMA) trained weights in diffusers format: the LoRA (``pipe.load_lora_weights(dir)``), or the
    fully fine-tuned transformer (``transformer.save_pretrained``). ``state``: the weights gathered from FSDP2
    shards (:func:`gathered_trained`, EMA already applied), written instead of the live ones."""
    if state is not None:
        return module.policy.save_trained(out_dir, state_dict=state)
    with ema_applied(module):
        return module.policy.save_trained(out_dir)
