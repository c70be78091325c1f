"""Parity with verl 0.9.1: every policy loss, aggregation mode, KL estimator and the value loss.

Random float64 inputs (several seeds), masks with all-zero rows, and ties (ratios of exactly
1, zero advantages, values exactly at and inside the value clip range). Values and gradients
must agree to 1e-6. verl's aggregation takes global counts (``dp_size``, ``batch_num_tokens``,
``global_batch_size``, ``loss_scale_factor``); treadle's ``agg_kwargs`` carry them divided by
the data-parallel size (``num_tokens``, ``num_seqs``, ``norm_constant``, ``dp_size``): both are
driven from the same totals here. Where the two differ on purpose the test says so.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from algorithm_calls import policy_loss
from reference import verl_core_algos
from torch.testing import assert_close

from treadle.algorithms import POLICY_LOSSES, Aggregation, agg_loss, kl_penalty, value_loss
from treadle.algorithms.kl import kl_full

SEEDS = (0, 1, 2)
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean")
TOL = {"rtol": 1e-6, "atol": 1e-6}
B, T = 6, 7


@pytest.fixture(scope="module")
def verl():
    return verl_core_algos()


def verl_config(global_batch_info: dict, **kw):
    """verl's ActorConfig with the policy-loss section built from ``kw``'s policy keys."""
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = {
        k: kw.pop(k)
        for k in list(kw)
        if k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
        or k == "dro_beta"
    }
    corr = kw.pop("rollout_correction", None)
    if corr is not None:
        policy["rollout_correction"] = RolloutCorrectionConfig(**corr)
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(**policy),
        global_batch_info=global_batch_info,
        **kw,
    )


def inputs(seed: int):
    """log π, log π_old (probabilities < 1), advantages, mask with an empty row, as float64.

    Ties: a few tokens have log π = log π_old exactly (ratio 1) and a few advantages are 0.
    """
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = torch.nn.functional.logsigmoid(z)
    logp = torch.nn.functional.logsigmoid(z + 0.4 * torch.randn(B, T, generator=g).double())
    tie = torch.rand(B, T, generator=g) < 0.15
    logp = torch.where(tie, old, logp)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.where(torch.rand(B, T, generator=g) < 0.1, 0.0, adv)
    adv[0] = 0.7  # one sequence-level (outcome) advantage, as GMPO expects
    mask = (torch.rand(B, T, generator=g) < 0.75).double()
    mask[1] = 0.0  # an empty response
    mask[0, 0] = 1.0
    return logp.requires_grad_(), old, adv, mask


def counts(mask: torch.Tensor, dp_size: int, loss_scale_factor: float | None = None):
    """The same global totals for both sides: (treadle agg_kwargs, verl global_batch_info)."""
    tokens, seqs = float(mask.sum()), float(mask.shape[0])
    ours = {
        "num_tokens": tokens / dp_size,
        "num_seqs": seqs / dp_size,
        "dp_size": dp_size,
        "norm_constant": loss_scale_factor,
    }
    theirs = {
        "dp_size": dp_size,
        "batch_num_tokens": tokens,
        "global_batch_size": seqs,
        "loss_scale_factor": loss_scale_factor,
    }
    return ours, theirs


def value_and_grad(loss: torch.Tensor, x: torch.Tensor):
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


# --------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("mode", [*MODES, "seq-mean-token-sum-norm"])
def test_agg_loss_matches_verl(verl, mode, dp_size, seed):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B, T, generator=g, dtype=torch.float64, requires_grad=True)
    _, _, _, mask = inputs(seed)
    for factor in (None, 5.0):
        ours, theirs = counts(mask, dp_size, factor)
        got = value_and_grad(agg_loss(loss_mat, mask, mode, **ours), loss_mat)
        want = value_and_grad(verl.agg_loss(loss_mat, mask, mode, **theirs), loss_mat)
        assert_close(got, want, **TOL)
    # without global counts both default to this micro-batch's own (dp_size 1)
    got = value_and_grad(agg_loss(loss_mat, mask, mode), loss_mat)
    assert_close(got, value_and_grad(verl.agg_loss(loss_mat, mask, mode), loss_mat), **TOL)


# --------------------------------------------------------------------------- policy losses

# treadle name, treadle options, verl name, verl ActorConfig options
CASES = [
    ("ppo", {"clip_ratio_c": 3.0}, "vanilla", {"clip_ratio_c": 3.0}),
    ("vanilla", {"clip_ratio_c": 10.0}, "vanilla", {"clip_ratio_c": 10.0}),
    # treadle's dual clip can be off; verl's is always on: a huge c never binds
    ("ppo", {"clip_ratio_c": None}, "vanilla", {"clip_ratio_c": 1e12}),
    (
        "ppo",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28},
        "vanilla",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28},
    ),
    ("gspo", {"clip_ratio_low": 3e-3, "clip_ratio_high": 4e-3}, "gspo", {}),
    ("cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 0.2}, "cispo", {}),
    ("gpg", {}, "gpg", {}),
    ("kl_cov", {"kl_cov_ratio": 0.1, "kl_cov_coef": 0.5}, "kl_cov", {}),
    ("sapo", {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}, "sapo", {"tau_pos": 1.0}),
    ("sapo", {"sapo_tau_pos": 2.0, "sapo_tau_neg": 3.0}, "sapo", {"tau_pos": 2.0}),
    ("dro", {"dro_beta": 0.3}, "dro", {"dro_beta": 0.3}),
    ("dppo_tv", {"dppo_divergence_low": 0.05}, "dppo_tv", {}),
    ("dppo_kl", {"dppo_divergence_low": 0.02}, "dppo_kl", {}),
    ("bypass_mode", {"bypass_loss_type": "ppo_clip"}, "bypass_mode", {}),
]


def fill_verl_options(name: str, ours: dict, theirs: dict) -> dict:
    """verl's keys for treadle's options (verl reads some of them from other fields)."""
    theirs = dict(theirs)
    theirs.setdefault("clip_ratio_low", ours.get("clip_ratio_low", 0.2))
    theirs.setdefault("clip_ratio_high", ours.get("clip_ratio_high", 0.2))
    if name == "gspo":
        theirs |= {"clip_ratio_low": 3e-3, "clip_ratio_high": 4e-3}
    if name == "cispo":
        theirs |= {"clip_ratio_low": 1.0, "clip_ratio_high": 0.2}
    if name == "kl_cov":
        theirs |= {"kl_cov_ratio": ours["kl_cov_ratio"], "ppo_kl_coef": ours["kl_cov_coef"]}
    if name == "sapo":
        theirs["tau_neg"] = ours["sapo_tau_neg"]
    if name.startswith("dppo"):  # verl: thresholds = clip_ratio_low/high, cap = clip_ratio_c
        theirs |= {
            "clip_ratio_low": ours.get("dppo_divergence_low", 0.2),
            "clip_ratio_high": ours.get("dppo_divergence_high", 0.2),
            "clip_ratio_c": ours.get("dppo_is_cap", 20.0),
        }
    if name == "bypass_mode":
        theirs["rollout_correction"] = {"rollout_is": None, "loss_type": "ppo_clip"}
    return theirs


# verl's SAPO aggregates with seq-mean-token-mean whatever the mode: compared in that mode only
LOSS_MODES = [
    (*case, mode)
    for case in CASES
    for mode in MODES
    if case[2] != "sapo" or mode == "seq-mean-token-mean"
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize(("name", "options", "verl_name", "verl_options", "mode"), LOSS_MODES)
def test_policy_loss_matches_verl(
    verl, name, options, verl_name, verl_options, mode, dp_size, seed
):
    logp, old, adv, mask = inputs(seed)
    ours, theirs = counts(mask, dp_size)
    cfg = verl_config(theirs, **fill_verl_options(name, options, verl_options))
    loss, metrics = policy_loss(
        name, logp, old, adv, mask, loss_agg_mode=mode, agg_kwargs=ours, **options
    )
    verl_loss, verl_metrics = verl.get_policy_loss_fn(verl_name)(
        old, logp, adv, mask, loss_agg_mode=mode, config=cfg
    )
    assert_close(value_and_grad(loss, logp), value_and_grad(verl_loss, logp), **TOL)
    if "actor/ppo_kl" in verl_metrics and name != "kl_cov":  # verl's kl_cov reports |log r|
        assert metrics["ppo_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-6)
    if "actor/pg_clipfrac" in verl_metrics and name not in ("kl_cov", "sapo"):
        assert metrics["pg_clipfrac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)
    if "actor/pg_clipfrac_lower" in verl_metrics and "pg_clipfrac_lower" in metrics:
        lower = verl_metrics["actor/pg_clipfrac_lower"]
        assert metrics["pg_clipfrac_lower"] == pytest.approx(lower, abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_rollout_is_weights_match_verl(verl, seed):
    """Rollout importance weights multiply the token losses the same way (GMPO: their
    geometric mean per sequence)."""
    logp, old, adv, mask = inputs(seed)
    weights = torch.rand(B, T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ours, theirs = counts(mask, 1)
    for name, verl_name in (("ppo", "vanilla"), ("cispo", "cispo"), ("geo_mean", "geo_mean")):
        mode = "seq-mean-token-mean" if name == "geo_mean" else "token-mean"
        cfg = verl_config(theirs)
        knobs = {
            "clip_ratio_c": 3.0,  # the config's default; the function's is off
            "clip_ratio_low": 0.2,  # verl's config value (cispo's own default is 1)
        }
        loss, _ = policy_loss(
            name,
            logp,
            old,
            adv,
            mask,
            loss_agg_mode=mode,
            agg_kwargs=ours,
            rollout_is_weights=weights,
            **{k: v for k, v in knobs.items() if k in POLICY_LOSSES.knobs(name)},
        )
        verl_loss, _ = verl.get_policy_loss_fn(verl_name)(
            old, logp, adv, mask, loss_agg_mode=mode, config=cfg, rollout_is_weights=weights
        )
        assert_close(value_and_grad(loss, logp), value_and_grad(verl_loss, logp), **TOL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.1, 0.4)])
def test_geo_mean_matches_verl(verl, low, high, seed):
    """GMPO: verl averages over the micro-batch's rows (``torch.mean``, its aggregation mode
    and global counts unused): treadle with ``num_seqs`` = the rows, one rank."""
    logp, old, adv, mask = inputs(seed)
    ours, theirs = counts(mask, 1)
    cfg = verl_config(theirs, clip_ratio_low=low, clip_ratio_high=high)
    loss, metrics = policy_loss(
        "geo_mean",
        logp,
        old,
        adv,
        mask,
        loss_agg_mode="seq-mean-token-mean",
        agg_kwargs=ours,
        clip_ratio_low=low,
        clip_ratio_high=high,
    )
    verl_loss, verl_metrics = verl.get_policy_loss_fn("geo_mean")(old, logp, adv, mask, config=cfg)
    assert_close(value_and_grad(loss, logp), value_and_grad(verl_loss, logp), **TOL)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert metrics[key] == pytest.approx(verl_metrics[f"actor/{key}"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_clip_cov_matches_verl_with_the_same_random_choice(verl, mode, seed):
    """Both draw the dropped tokens with one ``torch.randperm`` over the candidates in
    row-major order: the same global seed gives the same choice."""
    logp, old, adv, mask = inputs(seed)
    ours, theirs = counts(mask, 2)
    knobs = {"clip_cov_ratio": 0.1, "clip_cov_lb": -0.5, "clip_cov_ub": 0.5}
    cfg = verl_config(theirs, **knobs)
    torch.manual_seed(100 + seed)
    loss, metrics = policy_loss(
        "clip_cov", logp, old, adv, mask, loss_agg_mode=mode, agg_kwargs=ours, **knobs
    )
    torch.manual_seed(100 + seed)
    verl_loss, verl_metrics = verl.get_policy_loss_fn("clip_cov")(
        old, logp, adv, mask, loss_agg_mode=mode, config=cfg
    )
    assert metrics["pg_cov_frac"] > 0  # the inputs do drop tokens
    assert_close(value_and_grad(loss, logp), value_and_grad(verl_loss, logp), **TOL)
    # verl's pg_clipfrac is the dropped fraction (treadle: pg_cov_frac; pg_clipfrac is PPO's)
    assert metrics["pg_cov_frac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
def test_bypass_reinforce_matches_verl(verl, mode, level, seed):
    """bypass_mode with ``reinforce``: verl's REINFORCE loss with its truncated IS weights
    (``compute_rollout_correction_weights``, here called directly: verl's wrapper returns them
    in a DataProto, which needs tensordict)."""
    helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    logp, rollout, adv, mask = inputs(seed)
    ours, theirs = counts(mask, 2)
    loss, metrics = policy_loss(
        "bypass_mode",
        logp,
        rollout,
        adv,
        mask,
        loss_agg_mode=mode,
        agg_kwargs=ours,
        bypass_loss_type="reinforce",
        bypass_is=level,
        bypass_is_cap=1.5,
    )
    with torch.no_grad():
        weights, _ = helper.compute_rollout_correction_weights(
            logp - rollout, mask, rollout_is=level, rollout_is_threshold=1.5
        )
    verl_loss, verl_metrics = verl.compute_policy_loss_reinforce(
        rollout,
        logp,
        adv,
        mask,
        loss_agg_mode=mode,
        config=verl_config(theirs),
        rollout_is_weights=weights,
    )
    assert_close(value_and_grad(loss, logp), value_and_grad(verl_loss, logp), **TOL)
    assert metrics["ppo_kl"] == pytest.approx(verl_metrics["actor/ppo_kl"], abs=1e-6)


def test_every_verl_policy_loss_has_a_treadle_name(verl):
    assert set(verl.POLICY_LOSS_REGISTRY) <= set(POLICY_LOSSES.names())
    tested = {case[2] for case in CASES} | {"clip_cov", "geo_mean", "bypass_mode"}
    assert set(verl.POLICY_LOSS_REGISTRY) <= tested


# --------------------------------------------------------------------------- KL estimators

KL_NAMES = [
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", KL_NAMES)
def test_kl_estimator_matches_verl(verl, name, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    ref[0, :3] = logp[0, :3]  # ties: the policy equals the reference
    logp[1, 0], ref[1, 0] = -1.0, -30.0  # k3's clamps
    logp.requires_grad_()
    ref.requires_grad_()
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)  # a loss on top of the KL

    def both(kl: torch.Tensor):
        return kl.detach(), *torch.autograd.grad((kl * weights).sum(), (logp, ref))

    assert_close(both(kl_penalty(logp, ref, name)), both(verl.kl_penalty(logp, ref, name)), **TOL)


def test_full_kl_is_the_exact_kl_where_verl_has_none(verl):
    """verl 0.9.1 names ``full`` and raises; treadle's is Σ_v π(v)(log π(v) - log π_ref(v))."""
    g = torch.Generator().manual_seed(3)
    logp = torch.log_softmax(torch.randn(B, T, 11, generator=g, dtype=torch.float64), -1)
    ref = torch.log_softmax(torch.randn(B, T, 11, generator=g, dtype=torch.float64), -1)
    with pytest.raises(NotImplementedError):
        verl.kl_penalty(logp, ref, "full")
    want = torch.nn.functional.kl_div(ref, logp, reduction="none", log_target=True).sum(-1)
    assert_close(kl_full(logp, ref), want, **TOL)


# --------------------------------------------------------------------------- value loss


def value_inputs(seed: int):
    """Predictions, old values, returns; ties inside the clip range and at its bounds."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    returns = torch.randn(B, T, generator=g, dtype=torch.float64)
    # inside the range, where old + (v - old) != v in floating point
    old[0, :3] = torch.tensor([0.22, -0.06, 0.1], dtype=torch.float64)
    values[0, :3] = torch.tensor([0.05, 0.04, -0.05], dtype=torch.float64)
    # exactly at the bounds old ± 0.25 (dyadic: no round-off), and exactly the old value
    old[2, :3] = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    values[2, :3] = torch.tensor([0.75, -1.25, 2.0], dtype=torch.float64)
    _, _, _, mask = inputs(seed)
    return values.requires_grad_(), old, returns, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dp_size", [1, 2])
@pytest.mark.parametrize("mode", [*MODES, "seq-mean-token-sum-norm"])
def test_value_loss_matches_verl(verl, mode, dp_size, seed):
    values, old, returns, mask = value_inputs(seed)
    ours, theirs = counts(mask, dp_size)
    loss, clipfrac = value_loss(values, old, returns, mask, 0.25, Aggregation(mode, **ours))
    verl_loss, verl_clipfrac = verl.compute_value_loss(
        values, returns, old, mask, 0.25, mode, **theirs
    )
    assert_close(value_and_grad(loss, values), value_and_grad(verl_loss, values), **TOL)
    assert clipfrac == pytest.approx(float(verl_clipfrac), abs=1e-6)
