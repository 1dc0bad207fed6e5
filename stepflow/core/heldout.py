"""The held-out evaluation, reusable (no Hydra): deterministic ODE sampling, the GenEval table, sample grids (a saved LoRA
loads with :func:`stepflow.policies.base.read_lora`).

Used by ``python -m stepflow.evaluate``, by pretraining's periodic evaluation and by the GRPO loop's evaluation.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from stepflow.core import stop
from stepflow.errors import StopRequested
from stepflow.policies.base import FlowPolicy, encode_rows


@torch.no_grad()
def sample_ode(policy: FlowPolicy, prompts: Sequence[str], num_steps: int = 10, guidance: float = 1.0, seed: int = 0,
               batch_size: int = 64, generator: torch.Generator | None = None, offset: int = 0,
               total: int | None = None, dist=None, meta: Sequence[dict[str, Any]] | None = None) -> Tensor:
    """Deterministic Euler ODE sampling on ``policy.time_grid(num_steps)`` (from t=1, noise, to t=0, data).

    ``x_{k+1} = x_k + (t_{k+1} - t_k) * v(x_k, t_k)`` with ``v = x1 - x0`` (rectified flow). The initial noise of all
    ``len(prompts)`` samples is drawn at once from ``seed`` (on the CPU), so a sample depends on its index and the seed,
    not on ``batch_size``. ``offset`` / ``total``: these prompts are samples ``offset..`` of ``total`` (a rank's shard of
    an evaluation), so they get the noise they would get in one process. NFE = ``num_steps`` (x2 with guidance != 1).
    ``dist``: the ranks agree on a stop request before each batch (every rank must sample the same number of batches).
    ``meta``: the prompts' records (an editing model reads each one's source image off them, :func:`encode_rows`).
    Returns images (B, 3, H, W) in [0, 1] on the CPU.
    """
    prompts = list(prompts)
    if not prompts:
        return torch.zeros(0, 3, *policy.latent_shape[1:])
    gen = generator if generator is not None else torch.Generator().manual_seed(int(seed))
    noise = torch.randn((total or len(prompts), *policy.latent_shape), generator=gen)[offset:offset + len(prompts)]
    if len(noise) < len(prompts):  # padding rows beyond ``total`` (a rank's short shard): any noise, dropped later
        noise = torch.cat([noise, torch.zeros(len(prompts) - len(noise), *policy.latent_shape)])
    grid = policy.time_grid(num_steps).float().tolist()
    dev = policy.device
    out = []
    for i in range(0, len(prompts), batch_size):
        if dist is None:  # a stop request abandons a long evaluation between batches
            stop.check()
        elif dist.stop_requested():
            raise StopRequested(stop.reason())
        x = noise[i:i + batch_size].to(dev)
        cond = encode_rows(policy, prompts[i:i + batch_size], None if meta is None else meta[i:i + batch_size])
        for t, t_next in zip(grid[:-1], grid[1:]):
            v = policy.velocity(x, t, cond, guidance=guidance)
            x = x + (t_next - t) * v
        out.append(policy.decode(x).float().cpu())
    return torch.cat(out)


def expand_records(records: Sequence[dict[str, Any] | str], num_per_prompt: int = 1,
                   max_prompts: int | None = None) -> list[dict[str, Any]]:
    """Prompt records (dicts with ``prompt``, or bare strings) -> the list to sample, each repeated ``num_per_prompt``
    (adjacent). ``max_prompts`` keeps a category-balanced subset (:func:`balanced_subset`)."""
    recs = balanced_subset([r if isinstance(r, dict) else {"prompt": r} for r in records], max_prompts)
    return [r for r in recs for _ in range(int(num_per_prompt))]


def balanced_indices(records: Sequence[dict[str, Any]], n: int) -> list[int]:
    """The positions of ``n`` records taking the categories in turn (first-appearance order of the categories, file
    order within one), so that a small subset still covers every category."""
    by: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by.setdefault(str(r.get("category", r.get("tag", "all"))), []).append(i)
    n = min(int(n), len(records))
    out: list[int] = []
    depth = 0
    while len(out) < n:
        out += [idx[depth] for idx in by.values() if depth < len(idx)][:n - len(out)]
        depth += 1
    return out


def balanced_subset(records: Sequence[dict[str, Any]], n: int | None) -> list[dict[str, Any]]:
    """``n`` records taking the categories in turn (:func:`balanced_indices`); all records when ``n`` is None or not
    smaller than the file."""
    if n is None or int(n) >= len(records):
        return list(records)
    return [records[i] for i in balanced_indices(records, n)]


def evaluate_geneval(policy: FlowPolicy, prompt_records: Sequence[dict[str, Any] | str], num_steps: int = 10,
                     guidance: float = 1.0, seed: int = 0, num_per_prompt: int = 1, max_prompts: int | None = None,
                     batch_size: int = 64) -> tuple[dict[str, float], Tensor, list[dict[str, Any]]]:
    """Sample the prompts with :func:`sample_ode` and score them with the strict shapes-GenEval judge.

    Returns ``(table, images, records)``: ``table`` = ``{"geneval": overall, "geneval_<category>": ...}`` (strict
    accuracy), ``images`` (N, 3, H, W) in [0, 1] and the N sampled records (prompt order, repeats adjacent).
    """
    from stepflow.rewards.shapes_geneval import geneval_table

    recs = expand_records(prompt_records, num_per_prompt, max_prompts)
    prompts = [r["prompt"] for r in recs]
    images = sample_ode(policy, prompts, num_steps=num_steps, guidance=guidance, seed=seed, batch_size=batch_size)
    table = {k: float(v) for k, v in geneval_table(images, prompts).items()}
    return table, images, recs


#: reward components the held-out evaluation reports per category beside GenEval's table (``eval/exact_scene*``:
#: the fraction of exact scenes; ``eval/extra_objects*``: the mean number of objects not asked for)
SCENE_COMPONENTS = ("exact_scene", "extra_objects")


@torch.no_grad()
def evaluate_reward(policy: FlowPolicy, reward, records: Sequence[dict[str, Any]], num_steps: int = 10,
                    guidance: float = 1.0, seed: int = 0, batch_size: int = 64, dist=None, detail: dict | None = None
                    ) -> tuple[dict[str, float], Tensor, list[str]]:
    """The held-out evaluation of a training run: :func:`sample_ode` on the records' prompts, scored by ``reward``,
    sharded over the ranks of ``dist`` (a :class:`stepflow.core.dist.Dist`; each samples a contiguous slice with the noise
    it would have in one process, the per-sample scores are gathered).

    Returns ``({"eval/<reward>": mean score, "eval/geneval*": ...}, this rank's images, their prompts)``; NaN / inf
    scores are left out of the mean and counted (``eval/nonfinite_rewards``, only when there are any). The
    GenEval-style table (strict accuracy per category, their mean) comes from the reward's own ``strict`` component
    and each record's ``tag`` (or ``category``), when both exist; the judge runs once per image. With the components
    :data:`SCENE_COMPONENTS` as well, ``eval/exact_scene*`` and ``eval/extra_objects*`` are aggregated the same way
    (per category, then the unweighted mean over the categories). ``detail``: a dict
    that receives this rank's ``records``, per-sample ``scores`` and ``strict`` verdicts (None without them).
    """
    rank, world = (0, 1) if dist is None else (dist.rank, dist.world)
    n = len(records)
    per = -(-n // world)
    mine = list(records[rank * per:(rank + 1) * per])
    prompts = [r["prompt"] for r in mine]
    # every rank samples `per` prompts when the transformer's passes are collectives (FSDP2, DeepSpeed) or the ranks
    # agree on stopping per batch: the last rank's short slice is padded with the first prompt, its images dropped
    padded = prompts + [records[0]["prompt"]] * (per - len(prompts)) if world > 1 else prompts
    padded_meta = mine + [records[0]] * (len(padded) - len(prompts))
    images = sample_ode(policy, padded, num_steps=num_steps, guidance=guidance, seed=seed, batch_size=batch_size,
                        offset=rank * per, total=n, dist=dist if world > 1 else None, meta=padded_meta)[:len(prompts)]
    out = reward(images, prompts, mine) if mine else None
    if detail is not None:
        detail.update(records=mine, scores=None if out is None else out.scores.float().tolist(),
                      strict=None if out is None or "strict" not in out.components
                      else [bool(v > 0.5) for v in out.components["strict"].float().tolist()])
    tags = [r.get("tag", r.get("category")) for r in records]
    cols = [out.scores.float() if out is not None else torch.zeros(0)]
    strict = out is not None and "strict" in out.components and all(t is not None for t in tags)
    if strict:
        cols.append(out.components["strict"].float())
    # beside GenEval: exact scenes and objects not asked for, per category (the shapes judge's components)
    scene = strict and all(k in out.components for k in SCENE_COMPONENTS)
    if scene:
        cols += [out.components[k].float() for k in SCENE_COMPONENTS]
    local = torch.stack(cols, 1) if mine else torch.zeros(0, len(cols))
    if world > 1:  # pad every rank's rows to `per`, gather, drop the padding
        pad = torch.full((per, local.shape[1]), float("nan"))
        pad[:len(local)] = local
        local = dist.gather_rows(pad)[:n]
    finite = torch.isfinite(local[:, 0])
    res = {f"eval/{reward.name}": float(local[finite, 0].mean())} if bool(finite.any()) else {}
    if not bool(finite.all()):  # NaN / inf scores are counted, never averaged into the logged metric
        res["eval/nonfinite_rewards"] = float((~finite).sum())
        import logging

        logging.getLogger("stepflow.core.heldout").warning(
            "%d of %d held-out samples got a non-finite %s score: left out of eval/%s (eval/nonfinite_rewards)",
            int((~finite).sum()), n, reward.name, reward.name)
    if strict:
        from stepflow.rewards.shapes_geneval import table_from_strict

        passed = torch.nan_to_num(local[:, 1], nan=0.0, posinf=0.0, neginf=0.0)  # no valid judgement: not passed
        res.update({f"eval/{k}": v for k, v in table_from_strict(tags, passed.tolist()).items()})
    if scene:
        from stepflow.rewards.shapes_geneval import table_from_values

        for j, k in enumerate(SCENE_COMPONENTS, start=2):
            col = local[:, j]
            ok = torch.isfinite(col)
            res.update({f"eval/{name}": v for name, v in table_from_values(
                k, [t for t, g in zip(tags, ok.tolist()) if g], col[ok].tolist()).items()})
    return res, images, prompts


def format_table(table: dict[str, float]) -> str:
    """A two-column text table: overall first, then the categories."""
    keys = ["geneval"] + sorted(k for k in table if k != "geneval")
    width = max(len(k) for k in keys)
    return "\n".join(f"{k:<{width}}  {table[k]:.4f}" for k in keys if k in table)


def frame_strips(videos: Tensor, max_frames: int = 8) -> Tensor:
    """Videos (N, 3, F, H, W) -> one image per video (N, 3, H, n·W + n − 1): ``n = min(F, max_frames)`` frames evenly
    spaced from the first to the last, side by side with a 1-px white gap (a video's row in a sample grid)."""
    n_all = videos.shape[2]
    idx = sorted({int(round(x)) for x in torch.linspace(0, n_all - 1, min(n_all, max(1, int(max_frames)))).tolist()})
    frames = [videos[:, :, i] for i in idx]
    gap = torch.ones(*videos.shape[:2], videos.shape[3], 1, dtype=videos.dtype, device=videos.device)
    parts = [x for f in frames for x in (f, gap)][:-1]
    return torch.cat(parts, dim=-1)


def save_gif(video: Tensor, path: str | Path, fps: float = 8.0) -> Path:
    """One video (3, F, H, W) in [0, 1] as an animated GIF (PIL), ``fps`` frames per second, looping."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = (video.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0).cpu().numpy()
    frames = [Image.fromarray(a) for a in arr]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=max(1, int(round(1000 / fps))), loop=0)
    return path


def save_grid(images: Tensor, prompts: Sequence[str], path: str | Path, ncol: int = 8, title: str | None = None,
              scores: Sequence[float] | None = None, dpi: int = 100, passed: Sequence[bool] | None = None) -> Path:
    """Save ``images`` (N, 3, H, W) in [0, 1] as a PNG grid with each prompt (and optional score) as its title;
    ``passed``: a verdict per image, drawn as a green (passed) or red (failed) frame. Videos (N, 3, F, H, W): one
    frame strip per video (:func:`frame_strips`), a strip per row."""
    if images.ndim == 5:
        images = frame_strips(images)
        ncol = 1
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = images.shape[0]
    ncol = max(1, min(ncol, n))
    nrow = max(1, math.ceil(n / ncol))
    aspect = images.shape[-1] / max(1, images.shape[-2])  # frame strips are wide
    fig, axes = plt.subplots(nrow, ncol, figsize=(1.9 * ncol * max(1.0, aspect), 2.45 * nrow + (0.5 if title else 0)),
                             squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        ax = axes.flat[i]
        ax.imshow(images[i].detach().float().clamp(0, 1).permute(1, 2, 0).cpu().numpy(), interpolation="nearest")
        label = "\n".join(textwrap.wrap(prompts[i], int(22 * max(1.0, aspect)))[:3])
        if scores is not None:
            label += f"\n[{scores[i]:.2f}]"
        ax.set_title(label, fontsize=7)
        if passed is not None:  # a frame: axis("off") hides the spines, so draw them back in the verdict's colour
            ax.axis("on")
            ax.set_xticks([]), ax.set_yticks([])
            for sp in ax.spines.values():
                sp.set_color("tab:green" if passed[i] else "tab:red")
                sp.set_linewidth(2.5)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def save_category_grids(images: Tensor, records: Sequence[dict[str, Any]], out_dir: str | Path, per_category: int = 16,
                        ncol: int = 8, scores: Sequence[float] | None = None, prefix: str = "samples") -> list[Path]:
    """One PNG per category (``<prefix>_<category>.png``) with up to ``per_category`` samples each."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        groups[str(r.get("category", "all"))].append(i)
    paths = []
    for cat, idx in sorted(groups.items()):
        idx = idx[:per_category]
        paths.append(save_grid(images[idx], [records[i]["prompt"] for i in idx], Path(out_dir) / f"{prefix}_{cat}.png",
                               ncol=ncol, title=cat, scores=None if scores is None else [scores[i] for i in idx]))
    return paths
