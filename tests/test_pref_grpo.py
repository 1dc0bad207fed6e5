"""Pref-GRPO (advantage=pref_grpo, experiment=league/pref_grpo): the win rate of each sample within its group and its
group-normalised advantage, checked against transcriptions of the released lines (CodeGoat24/Pref-GRPO@c06662d5fa99
fastvideo/train_flux_pref_grpo.py), written here in plain Python / torch, independently of stepflow's code; the
reward's pairwise interface (Reward.compare, Reward.pairwise) and the pairwise judge's reward phase; the Flow-GRPO step
the release trains with; NFEs; the recipe; refusals."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from stepflow.core.data import IterationPlan
from stepflow.core.dist import Dist
from stepflow.credits.pref_grpo import PairwiseRollout, PrefGrpo, group_pairs, win_rates_from_scores
from stepflow.rewards.base import Reward, RewardOut, preference_from_scores
from stepflow.rollouts.base import Collected
from stepflow.testing.harness import compose_config, run_in_process, smoke_config

REF = "CodeGoat24/Pref-GRPO@c06662d5fa99 fastvideo/train_flux_pref_grpo.py"


# ---------------------------------------------------------------- the released lines, transcribed
def released_win_rate(answers: dict[tuple[int, int], str], n: int) -> list[float]:
    """cal_win_rate (L73-138): ``pairs = list(itertools.combinations(enumerate(images), 2))``; per judged pair
    ``compare_count[idx1] += 1; compare_count[idx2] += 1``; ``"Image 1 is better"`` -> ``win_count[idx1] += 1``,
    ``"Image 2 is better"`` -> ``win_count[idx2] += 1``, anything else (a tie, an unparsable answer) ->
    ``win_count[idx1] += 0.5; win_count[idx2] += 0.5``; ``round(win_count[idx] / compare_count[idx], 3)``."""
    win_count, compare_count = defaultdict(int), defaultdict(int)
    for (idx1, _), (idx2, _) in itertools.combinations(enumerate(range(n)), 2):
        compare_count[idx1] += 1
        compare_count[idx2] += 1
        final_conclusion = answers[(idx1, idx2)]
        if "Image 1 is better" in final_conclusion:
            win_count[idx1] += 1
        elif "Image 2 is better" in final_conclusion:
            win_count[idx2] += 1
        else:
            win_count[idx1] += 0.5
            win_count[idx2] += 0.5
    return [round(win_count[idx] / compare_count[idx], 3) if compare_count[idx] > 0 else 0.0 for idx in range(n)]


def released_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """L633-654 (use_group, use_unifiedreward_think, no use_clip) and the clamp of L706-710: per group
    ``(group_rewards - group_rewards.mean()) / (group_rewards.std() + 1e-8)``, ``0.7 * advantages + 1.4 *
    clip_advantages`` (clip_advantages zeros), ``torch.clamp(advantages, -adv_clip_max, adv_clip_max)`` with 5.0."""
    advantages = torch.zeros_like(rewards)
    clip_advantages = torch.zeros_like(rewards)
    for i in range(len(rewards) // num_generations):
        start_idx, end_idx = i * num_generations, (i + 1) * num_generations
        group_rewards = rewards[start_idx:end_idx]
        group_mean = group_rewards.mean()
        group_std = group_rewards.std() + 1e-8
        advantages[start_idx:end_idx] = (group_rewards - group_mean) / group_std
    return torch.clamp(0.7 * advantages + 1.4 * clip_advantages, -5.0, 5.0)


def released_flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample):
    """flow_grpo_step (L149-186), prev_sample given (the update's recomputation)."""
    sigma = sigmas[index]
    sigma_prev = sigmas[index + 1]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    log_prob = (-((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t * torch.sqrt(-1 * dt)


def _answer(p: float) -> str:
    return {1.0: "Image 1 is better", 0.0: "Image 2 is better"}.get(p, "no answer")


# ---------------------------------------------------------------- win rates
def test_win_rates_of_a_judge_match_the_released_count():
    """One group of 5 and one of 3; each pair's verdict given (1: the first wins, 0: the second, 0.5: a tie or an
    unparsable answer); our counts from the same preferences equal the release's, rounded alike."""
    from stepflow.credits.pref_grpo import win_counts, win_rates

    groups = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    first, second = group_pairs(groups)
    verdicts = torch.tensor([1, 0, 0.5, 1, 1, 0, 0, 0.5, 1, 1, 0, 1, 0.5])  # 10 pairs of group 0, 3 of group 1
    assert len(first) == 13
    wins, count = win_counts(first, second, verdicts, 8)
    ours = win_rates(wins, count).tolist()
    ref0 = released_win_rate({(int(a), int(b)): _answer(float(p)) for a, b, p in zip(first[:10], second[:10], verdicts)}, 5)
    ref1 = released_win_rate({(int(a) - 5, int(b) - 5): _answer(float(p))
                              for a, b, p in zip(first[10:], second[10:], verdicts[10:])}, 3)
    assert ours == pytest.approx(ref0 + ref1, abs=1e-6)
    # the pairs are itertools.combinations' order within each group
    assert list(zip(first[:10].tolist(), second[:10].tolist())) == list(itertools.combinations(range(5), 2))


def test_win_rates_of_a_scalar_reward_compare_the_scores_and_split_ties():
    """A scalar reward: the pair's verdict is the higher score, a tie split 1/2 (as the release splits a judge's
    tie). Hand-worked group [0.2, 0.5, 0.5, 0.9]: wins 0, 1.5, 1.5, 3 over 3 comparisons each."""
    scores = torch.tensor([0.2, 0.5, 0.5, 0.9, 1.0, 1.0])
    groups = torch.tensor([3, 3, 3, 3, 7, 7])
    got = win_rates_from_scores(scores, groups)
    assert got.tolist() == pytest.approx([0.0, 0.5, 0.5, 1.0, 0.5, 0.5])
    answers = {(i, j): _answer(1.0 if scores[i] > scores[j] else 0.0 if scores[i] < scores[j] else 0.5)
               for i, j in itertools.combinations(range(4), 2)}
    assert got[:4].tolist() == pytest.approx(released_win_rate(answers, 4))
    # a row whose score is NaN takes part in no comparison (and is dropped by the iteration)
    nan = win_rates_from_scores(torch.tensor([0.1, float("nan"), 0.3]), torch.tensor([0, 0, 0]))
    assert math.isnan(nan[1]) and nan[0] == 0.0 and nan[2] == 1.0


def test_a_scalar_rewards_default_compare_is_the_comparison_of_its_scores():
    class Brightness(Reward):
        name = "brightness"

        def score(self, images, prompts, meta):
            return RewardOut(images.mean(dim=(1, 2, 3)).round(decimals=1))

    a = torch.tensor([0.2, 0.6, 0.5]).view(3, 1, 1, 1).expand(3, 3, 4, 4)
    b = torch.tensor([0.4, 0.6, 0.1]).view(3, 1, 1, 1).expand(3, 3, 4, 4)
    r = Brightness()
    assert not r.pairwise
    assert r.compare(a, b, ["p"] * 3).tolist() == [0.0, 0.5, 1.0]
    assert preference_from_scores(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])).tolist() == [0.5, 1.0]


# ---------------------------------------------------------------- advantages
def test_advantages_match_the_released_lines():
    """Two groups of 8 win rates (one with ties, one constant): the credit equals the release's 0.7·(w − mean)/(std +
    1e-8) with the unbiased std, clamped to ±5, at every step."""
    w = torch.tensor([0.0, 0.143, 0.286, 0.429, 0.571, 0.714, 0.857, 1.0, *[0.5] * 8])
    ids = torch.arange(2).repeat_interleave(8)
    rewards = torch.full((16, 5), float("nan"))
    rewards[:, -1] = w
    out = PrefGrpo()(rewards, ids, 4)
    ref = released_advantages(w.clone(), 8)
    assert out.advantages.shape == (16, 4)
    torch.testing.assert_close(out.advantages, ref.view(-1, 1).expand(16, 4), atol=1e-6, rtol=0)
    assert out.advantages[8:].abs().max() == 0  # a constant group: exactly 0


def test_the_flow_grpo_step_it_trains_with_matches_the_released_step():
    """The release's --grpo_step_mode flow on FastVideo's grid (sd3_time_shift(3, linspace(1, 0, 26)), L397-399) is
    sampler=flow_sde with a = η and t_guard = sigmas[1] (loop.time_grid=fastvideo)."""
    from stepflow.math.sde import SamplerConfig, fastvideo_time_grid, sde_step

    sigmas = (3 * torch.linspace(1, 0, 26)) / (1 + 2 * torch.linspace(1, 0, 26))
    torch.testing.assert_close(fastvideo_time_grid(25, 3.0), sigmas)
    g = torch.Generator().manual_seed(0)
    x, v, nxt = (torch.randn(3, 4, 5, 5, generator=g) for _ in range(3))
    sampler = SamplerConfig("flow_sde", a=0.7)
    for index in (0, 7, 23):
        lp, mean, std = released_flow_grpo_step(v, x, 0.7, sigmas, index, nxt)
        out = sde_step(sampler, x, v, sigmas[index], sigmas[index + 1], t_guard=sigmas[1], prev_sample=nxt)
        torch.testing.assert_close(out.mean, mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.std, std.expand(3), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out.log_prob, lp, atol=1e-4, rtol=1e-5)


# ---------------------------------------------------------------- the pairwise judge's reward phase
class LeftBrighterJudge(Reward):
    """A pairwise judge without scalar scores: the image whose left half is brighter wins; equal halves tie."""

    name = "left_brighter"
    pairwise = True

    def __init__(self):
        self.calls = 0

    def score(self, images, prompts, meta):
        raise AssertionError("a pairwise judge is asked about pairs only")

    def compare(self, images_a, images_b, prompts, meta=None):
        self.calls += len(images_a)
        la, lb = images_a[..., :2].mean(dim=(1, 2, 3)), images_b[..., :2].mean(dim=(1, 2, 3))
        return (la > lb).float() + 0.5 * (la == lb).float()


def _judge_learner(levels, groups, world=1, rank=0):
    n = len(levels)
    latents = torch.zeros(n, 3, 3, 2, 4)
    latents[:, -1] = torch.tensor(levels).view(n, 1, 1, 1)
    plan = IterationPlan([f"p{int(g)}" for g in groups], [{} for _ in groups], torch.tensor(groups),
                         torch.arange(n), torch.arange(n))
    dist = Dist(rank=rank, world=world)
    learner = SimpleNamespace(
        reward=LeftBrighterJudge(), dist=dist, advantage=PrefGrpo(),
        policy=SimpleNamespace(decode=lambda z: z.expand(-1, 3, -1, -1).clamp(0, 1)),
        plan=SimpleNamespace(plan=lambda it: plan))
    traj = SimpleNamespace(latents=latents, batch_size=n, num_steps=2)
    return learner, Collected(traj), plan


def test_a_pairwise_judges_reward_phase_calls_compare_on_every_pair_of_each_group():
    levels, groups = [0.1, 0.7, 0.7, 0.3, 0.9, 0.2], [0, 0, 0, 0, 1, 1]
    learner, col, plan = _judge_learner(levels, groups)
    col = PairwiseRollout().score(learner, col, plan, SimpleNamespace(it=0))
    assert learner.reward.calls == 6 + 1  # C(4, 2) + C(2, 2)
    answers = {(i, j): _answer(1.0 if levels[i] > levels[j] else 0.0 if levels[i] < levels[j] else 0.5)
               for i, j in itertools.combinations(range(4), 2)}
    ref = released_win_rate(answers, 4) + [1.0, 0.0]
    assert col.scores.rewards[:, -1].tolist() == pytest.approx(ref)
    assert bool(col.scores.rewards[:, :-1].isnan().all()) and col.scores.images == 14
    # the advantage phase reads them as win rates (not compared again)
    cred = PairwiseRollout().credit(learner_with_finite(learner), col, col.scores.rewards, plan, SimpleNamespace(it=0, trained=[0]))
    torch.testing.assert_close(cred.out.advantages[:4, 0], 0.7 * _norm(torch.tensor(ref[:4])), atol=1e-5, rtol=0)


def learner_with_finite(learner):
    learner.loop = SimpleNamespace(num_steps=2, max_nonfinite_frac=0.5)
    return learner


def _norm(w):
    return (w - w.mean()) / (w.std() + 1e-8)


def test_a_pairwise_judge_refuses_the_overlapped_reward_phase_in_one_line():
    learner, _, plan = _judge_learner([0.1, 0.2], [0, 0])
    learner.loop = SimpleNamespace(overlap_reward=True)
    with pytest.raises(ValueError) as err:
        PairwiseRollout().collect(learner, plan, SimpleNamespace(it=0), None)
    assert str(err.value) == ("loop.overlap_reward: a pairwise judge (reward left_brighter) compares the images of a "
                              "group once the whole rollout exists; set loop.overlap_reward=false")


def test_a_pairwise_judges_pairs_split_over_ranks_sum_to_the_one_process_counts(monkeypatch):
    """Rank r judges pairs r, r + world, ...; the counts summed over ranks (all_sum_tensor, here summed by hand) give
    the one-process win rates, and each rank keeps its own rows."""
    levels, groups = [0.1, 0.7, 0.4, 0.3, 0.9, 0.2, 0.5, 0.5], [0, 0, 0, 0, 0, 0, 1, 1]
    parts = []
    for rank in (0, 1):
        learner, col, plan = _judge_learner(levels, groups, world=2, rank=rank)
        every = learner.policy.decode(col.traj.latents[:, -1])  # what gather_rows would return on each rank
        col.traj.latents = col.traj.latents[rank * 4:(rank + 1) * 4]  # this rank's rows
        col.traj.batch_size = 4
        learner.dist.gather_rows = lambda x, every=every: every
        learner.dist.all_sum_tensor = lambda x, parts=parts: parts.append(x) or x
        PairwiseRollout().score(learner, col, plan, SimpleNamespace(it=0))
    assert len(parts) == 2 and int(parts[0][1].sum() + parts[1][1].sum()) == 2 * (15 + 1)
    total = parts[0] + parts[1]
    one_learner, one_col, one_plan = _judge_learner(levels, groups)
    one = PairwiseRollout().score(one_learner, one_col, one_plan, SimpleNamespace(it=0)).scores.rewards[:, -1]
    assert torch.round(total[0] / total[1], decimals=3).float().tolist() == pytest.approx(one.tolist())


# ---------------------------------------------------------------- the loop: NFEs, recipe, refusals
def test_nfes_are_the_flow_grpo_step_counted_as_every_method(tmp_path):
    """Rollout B·T NFEs (one velocity a step, no CFG); the update one forward with gradients (+ its backward, 2
    forward-equivalents) per trained (sample, step): int(int(0.99·4)·0.6) = 1 step per sample; no reward images
    beyond the B final ones (the scalar path compares scores)."""
    from stepflow.train import build_module

    cfg = smoke_config("advantage=pref_grpo", "sampler=flow_sde", "loop.time_grid=fastvideo", "train.timestep_fraction=0.99",
                       "train.train_steps=null", "train.step_subset=random_per_sample", "train.step_fraction=0.6",
                       "train.drop_zero_adv=false", "train.updates_per_iter=1")
    m = build_module(cfg, tmp_path).iterate()
    b, t = 8, 4
    assert m["cost/nfe_rollout"] == b * t and m["train/steps_per_sample"] == 1
    assert m["cost/nfe_backward"] == b * 1 and m["cost/nfe"] == b * t + b
    assert m["cost/nfe_fwd_equiv"] == b * t + b + 2 * b and m["cost/reward_images"] == b


def test_the_recipe_composes_as_released():
    from stepflow.train import settings

    cfg = compose_config("train", ["experiment=league/pref_grpo"])
    s = settings(cfg)
    assert type(s.advantage) is PrefGrpo and s.advantage.weight == 0.7 and s.advantage.decimals == 3
    assert s.advantage.unbiased_std and s.advantage.eps == 1e-8 and s.advantage.std_scope == "group"
    assert s.sampler.name == "flow_sde" and s.sampler.a == 0.7
    assert cfg.loop.group_size == 8 and cfg.loop.same_latent and cfg.loop.time_grid == "fastvideo"
    assert cfg.train.step_subset == "random_per_sample" and cfg.train.step_fraction == 0.6
    assert cfg.train.clip_eps == 1e-4 and cfg.train.beta_kl == 0.0 and cfg.train.updates_per_iter == 2


@pytest.mark.parametrize("field,value,needle", [
    ("weight", 0, "weight: must be a float > 0, got 0"),
    ("decimals", -1, "decimals: must be null or an int >= 0, got -1"),
    ("unbiased_std", "yes", "unbiased_std: must be a bool, got 'yes'"),
])
def test_refusals_name_the_field(field, value, needle):
    with pytest.raises(ValueError) as err:
        PrefGrpo(**{field: value})
    assert str(err.value) == needle


@pytest.mark.slow
def test_refusal_on_the_command_line_is_one_line(tmp_path):
    r = run_in_process("stepflow.train", "experiment=league/pref_grpo", "advantage.weight=-1", f"hydra.run.dir={tmp_path}")
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "advantage.weight: must be a float > 0" in err[0], r.stderr[-1500:]


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_one_iteration_trains_with_lora_and_full_finetuning(tmp_path, finetune, tiny_clip_dir):
    """Rewards that differ (tiny PickScore) so that advantages are not 0: the LoRA of the shapes model and the full
    transformer of the tiny SD3 pipeline (model.finetune=full) both move with a finite loss and gradient."""
    from stepflow.train import build_module

    model = (["model=sd3_tiny", "model.finetune=full", "reward=pickscore", f"reward.model_path={tiny_clip_dir}",
              f"reward.processor_path={tiny_clip_dir}", "eval.guidance=1", "loop.num_steps=3"]
             if finetune == "full" else ["reward=pickscore_tiny"])
    cfg = smoke_config(*model, "advantage=pref_grpo", "sampler=flow_sde", "train.updates_per_iter=1", "train.lr=1e-2")
    module = build_module(cfg, tmp_path)
    params = dict(module.policy.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    m = module.iterate()
    assert m["train/samples_trained"] > 0 and math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0
    assert math.isfinite(m["train/policy_loss"])
    assert max(float((params[n].detach() - b).abs().max()) for n, b in before.items()) > 0
