"""Rollout correction (algorithm.rollout_correction): TIS and MIS weights by hand."""

from __future__ import annotations

import math

import pytest
import torch
from algorithm_calls import policy_loss

from treadle.algorithms.correction import rollout_correction
from treadle.config import load_config
from treadle.runtime.errors import ConfigError

# pi_old / pi_rollout = 1, 3, 0.5, 2.5 on four valid tokens; a padded fifth holds -inf
OLD = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2), math.log(0.5), -math.inf]])
ROLLOUT = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.4), math.log(0.2), 0.0]])
MASK = torch.tensor([[1, 1, 1, 1, 0]])


def test_tis_truncates_the_ratio_at_the_cap():
    w, mask, over = rollout_correction(OLD, ROLLOUT, MASK, "tis", 2.0)
    assert w is not None
    torch.testing.assert_close(w[0, :4], torch.tensor([1.0, 2.0, 0.5, 2.0]))
    assert torch.isfinite(w).all()
    assert torch.equal(mask, MASK) and over == 0.5  # 3 and 2.5 are over the cap of 2


def test_mis_drops_tokens_over_the_cap_and_keeps_the_ratio_elsewhere():
    w, mask, over = rollout_correction(OLD, ROLLOUT, MASK, "mis", 2.0)
    assert w is not None
    torch.testing.assert_close(w[0, :4], torch.tensor([1.0, 0.0, 0.5, 0.0]))
    assert mask.tolist() == [[1, 0, 1, 0, 0]] and over == 0.5
    w, mask, over = rollout_correction(OLD, ROLLOUT, MASK, "mis", 4.0)  # a higher cap keeps all
    torch.testing.assert_close(w[0, :4], torch.tensor([1.0, 3.0, 0.5, 2.5]))
    assert mask.tolist() == MASK.tolist() and over == 0.0


def test_none_changes_nothing_and_unknown_modes_are_refused():
    w, mask, over = rollout_correction(OLD, ROLLOUT, MASK, "none", 2.0)
    assert w is None and mask is MASK and over == 0.0
    with pytest.raises(ValueError, match="rollout correction 'cispo'"):
        rollout_correction(OLD, ROLLOUT, MASK, "cispo", 2.0)


def test_the_weights_scale_the_policy_gradient_term_per_token():
    """PPO on-policy (ratio 1 to pi_old, inside the clip), token-mean:
    loss = -sum(w * A) / valid tokens."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
    mask = torch.ones(1, 4)
    rollout = logp.detach() - torch.tensor([[0.0, math.log(3), math.log(0.5), math.log(2.5)]])
    w, pg_mask, _ = rollout_correction(logp.detach(), rollout, mask, "tis", 2.0)
    loss, _ = policy_loss("ppo", logp, logp.detach(), adv, pg_mask, rollout_is_weights=w)
    expected = -(1.0 * 1.0 + 2.0 * -2.0 + 0.5 * 0.5 + 2.0 * 4.0) / 4
    assert float(loss) == pytest.approx(expected)
    loss.backward()  # d loss / d logp_t = -w_t A_t / 4 (the ratio's derivative is 1)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25, 1.0, -0.0625, -2.0]]))


def test_the_config_names_the_modes():
    cfg = load_config(None, ["algorithm.rollout_correction=mis"])
    assert cfg.algorithm.rollout_correction_cap == 2.0
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction"):
        load_config(None, ["algorithm.rollout_correction=ratio"])
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_correction_cap"):
        load_config(None, ["algorithm.rollout_correction_cap=0.5"])
