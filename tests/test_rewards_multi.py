"""MultiReward: Flow-GRPO's weighted sum and the two per-batch-normalized modes, checked against hand-computed
numbers; components carry each sub-reward's raw score; the whole batch is normalized at once."""

from __future__ import annotations

import pytest
import torch

from stepflow.rewards.base import Reward, RewardOut
from stepflow.rewards.multi import MultiReward, standardize


class Fixed(Reward):
    """Returns fixed per-image scores (indexed by the prompt, an integer string) and counts its calls."""

    def __init__(self, values, batch_size=2):
        self.values, self.batch_size, self.calls = torch.tensor(values), batch_size, 0

    def score(self, images, prompts, meta):
        self.calls += 1
        v = self.values[[int(p) for p in prompts]]
        return RewardOut(v, {"double": 2 * v})


A = [1.0, 2.0, 3.0, 6.0]
B = [10.0, 10.0, 30.0, 30.0]
PROMPTS = ["0", "1", "2", "3"]
IMGS = torch.zeros(4, 3, 8, 8)


def _multi(mode):
    return MultiReward({"a": Fixed(A), "b": Fixed(B)}, {"a": 0.5, "b": 0.1}, mode=mode)


def test_sum_is_flow_grpo_weighted_sum():
    out = _multi("sum")(IMGS, PROMPTS)
    torch.testing.assert_close(out.scores, torch.tensor([1.5, 2.0, 4.5, 6.0]))  # 0.5 a + 0.1 b
    torch.testing.assert_close(out.components["a"], torch.tensor(A))
    torch.testing.assert_close(out.components["b"], torch.tensor(B))
    torch.testing.assert_close(out.components["a/double"], 2 * torch.tensor(A))
    torch.testing.assert_close(out.components["weighted_sum"], out.scores)


def test_sum_then_normalize():
    out = _multi("sum_then_normalize")(IMGS, PROMPTS)
    s = [1.5, 2.0, 4.5, 6.0]  # mean 3.5, population var (4 + 2.25 + 1 + 6.25) / 4 = 3.375
    expected = torch.tensor([(x - 3.5) / (3.375 ** 0.5 + 1e-6) for x in s])
    torch.testing.assert_close(out.scores, expected)
    torch.testing.assert_close(out.components["weighted_sum"], torch.tensor(s))


def test_normalize_then_sum():
    out = _multi("normalize_then_sum")(IMGS, PROMPTS)
    za = [(x - 3.0) / (3.5 ** 0.5 + 1e-6) for x in A]  # mean 3, population var (4 + 1 + 0 + 9) / 4 = 3.5
    zb = [-1.0, -1.0, 1.0, 1.0]                          # mean 20, std 10 (eps negligible at this tolerance)
    expected = torch.tensor([0.5 * x + 0.1 * y for x, y in zip(za, zb)])
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=1e-6)
    # the sub-rewards' scale no longer matters: multiply b by 1000 and the score is unchanged
    big = MultiReward({"a": Fixed(A), "b": Fixed([1000 * x for x in B])}, {"a": 0.5, "b": 0.1},
                      mode="normalize_then_sum")(IMGS, PROMPTS)
    torch.testing.assert_close(big.scores, expected, rtol=1e-5, atol=1e-6)


def test_whole_batch_is_normalized_at_once():
    sub = Fixed(A, batch_size=2)
    m = MultiReward({"a": sub}, {"a": 1.0}, mode="sum_then_normalize")
    out = m(IMGS, PROMPTS)  # the sub-reward still chunks (2 calls) but z uses all 4 scores
    assert sub.calls == 2
    torch.testing.assert_close(out.scores, standardize(torch.tensor(A)))
    assert out.scores.mean().abs() < 1e-6
    torch.testing.assert_close(standardize(torch.tensor([5.0])), torch.tensor([0.0]))


def test_config_errors_and_nested_configs():
    with pytest.raises(ValueError, match="same"):
        MultiReward({"a": Fixed(A)}, {"a": 1.0, "b": 1.0})
    with pytest.raises(ValueError, match="mode"):
        MultiReward({"a": Fixed(A)}, {"a": 1.0}, mode="mean")
    # sub-rewards given as nested configs are built with build_reward (here OCR with a dotted engine)
    m = MultiReward({"ocr": {"_target_": "stepflow.rewards.ocr.OCRReward", "engine": "builtins:str"}}, {"ocr": 2.0})
    imgs = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])
    out = m(imgs, ['say "0"', 'say "0"'])  # str(black array) contains "0"; str(white array) has only 255s
    torch.testing.assert_close(out.components["ocr"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out.scores, torch.tensor([2.0, 0.0]))
