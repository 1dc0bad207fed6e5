"""Prompt plans: PromptPlanner (determinism, sampling without replacement, category balancing, sharding)."""

from __future__ import annotations

import collections

import pytest

from stepflow.core.data import PromptPlanner, balance_records, load_prompt_file
from stepflow.errors import PromptFileError
from stepflow.shapes import prompt_file


def _records(counts: dict[str, int]) -> list[dict]:
    return [{"prompt": f"{c} {i}", "category": c} for c, n in counts.items() for i in range(n)]


def test_plan_is_a_pure_function_of_seed_and_iteration():
    recs = _records({"a": 7, "b": 5})
    s1, s2 = PromptPlanner(recs, 3, 4, seed=5), PromptPlanner(recs, 3, 4, seed=5)
    assert s1.plan(9).prompts == s2.plan(9).prompts
    assert s1.plan(9).step_noise_seeds.tolist() == s2.plan(9).step_noise_seeds.tolist()
    assert s1.plan(9).prompts != PromptPlanner(recs, 3, 4, seed=6).plan(9).prompts or s1.plan(8).prompts != s1.plan(9).prompts


def test_without_replacement_within_an_epoch():
    recs = _records({"a": 12})
    s = PromptPlanner(recs, 4, 2, seed=0)
    drawn = [p for it in range(3) for p in s.plan(it).prompts[::2]]  # 3 iterations x 4 prompts = one epoch of 12
    assert sorted(drawn) == sorted(r["prompt"] for r in recs)


def test_balance_records_repeats_small_categories():
    recs = _records({"a": 12, "b": 4, "c": 3, "d": 5})
    out = balance_records(recs, "category")
    c = collections.Counter(r["category"] for r in out)
    # round(12 / n) copies of each record: a 12 x 1, b 4 x 3, c 3 x 4, d 5 x round(2.4) = 2
    assert c == {"a": 12, "b": 12, "c": 12, "d": 10}


def test_balanced_sampler_draws_categories_about_equally_on_the_shapes_train_file():
    recs = load_prompt_file(prompt_file("train"))
    plain = PromptPlanner(recs, 8, 2, seed=0)
    bal = PromptPlanner(recs, 8, 2, seed=0, balance_by="category")
    iters = 100  # 800 prompts ~ one epoch of the balanced list

    def freq(s):
        c = collections.Counter(m["category"] for it in range(iters) for m in s.plan(it).meta[::2])
        return {k: v / (8 * iters) for k, v in c.items()}

    f_plain, f_bal = freq(plain), freq(bal)
    assert f_plain["color_attr"] > 0.6  # the file is 74 % color_attr
    assert len(f_bal) == 6 and max(f_bal.values()) < 0.22 and min(f_bal.values()) > 0.12, f_bal


def test_balance_by_a_missing_key_is_a_one_line_error():
    with pytest.raises(PromptFileError, match=r"data.balance_by: prompt record 0 has no key 'tag'"):
        PromptPlanner(_records({"a": 3}), 2, 2, balance_by="tag")


def test_shards_partition_the_global_plan():
    recs = _records({"a": 9})
    plan = PromptPlanner(recs, 4, 4, seed=1).plan(3)
    parts = [plan.shard(r, 2) for r in range(2)]
    assert parts[0].prompts + parts[1].prompts == plan.prompts
    assert parts[0].step_noise_seeds.tolist() + parts[1].step_noise_seeds.tolist() == plan.step_noise_seeds.tolist()
