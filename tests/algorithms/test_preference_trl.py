"""The DPO family, ORPO, SimPO and KTO against TRL 1.16, in float64 on random inputs.

TRL computes these losses inside trainer methods that run the model: ``DPOTrainer._compute_loss``
and ``KTOTrainer._compute_loss`` are called here on a stand-in ``self`` (the config attributes,
an identity ``accelerator``) with a stand-in model that returns given per-token log-probs, so
TRL's own loss code runs on our numbers; ``ORPOTrainer.odds_ratio_loss`` and
``CPOTrainer.cpo_loss`` (SimPO) take log-probs directly. Values (per pair: TRL's batch mean of
one pair) and gradients match to 1e-6 unless a test says why not.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict
from typing import Any

import pytest
import torch
from algorithm_calls import pair_loss, unpaired_loss
from reference import trl_module

from treadle.algorithms import PREFERENCE_LOSSES, UNPAIRED_LOSSES, kto_kl
from treadle.algorithms.preference import f_divergence_scores

B = 7
TOL = {"atol": 1e-6, "rtol": 1e-6}

# every pair loss of TRL 1.16's DPOTrainer but "sft" (= dpo.nll_coef), with the knobs it reads
DPO_CASES: list[tuple[str, dict[str, Any]]] = [
    ("sigmoid", {}),
    ("hinge", {}),
    ("robust", {"label_smoothing": 0.2}),
    ("robust", {}),
    ("exo_pair", {"label_smoothing": 1e-3}),
    ("exo_pair", {"label_smoothing": 0.3}),
    ("nca_pair", {}),
    ("bco_pair", {}),
    ("sppo_hard", {}),
    ("aot", {}),
    ("aot", {"label_smoothing": 0.1}),
    ("aot_unpaired", {"label_smoothing": 0.1}),
    ("apo_zero", {}),
    ("apo_down", {}),
    ("discopop", {"discopop_tau": 0.05}),
    ("discopop", {"discopop_tau": 0.7}),
    ("sigmoid_norm", {}),
]
F_CASES = [  # TRL's f_divergence_type on the losses built on the chosen - rejected difference
    (name, kind)
    for name in ("sigmoid", "hinge", "robust", "exo_pair", "discopop", "sigmoid_norm")
    for kind in ("forward_kl", "js_divergence")
]


def pair_inputs(n: int = B, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random sequence log-probs and lengths; pair 0 is a tie (h = 0), pair 1 has π = π_ref."""
    g = torch.Generator().manual_seed(seed)

    def logps() -> torch.Tensor:
        return -(torch.rand(n, generator=g, dtype=torch.float64) * 20 + 0.5)

    x = {"pc": logps(), "pr": logps(), "rc": logps(), "rr": logps()}
    x["lc"] = torch.randint(1, 12, (n,), generator=g).double()
    x["lr"] = torch.randint(1, 12, (n,), generator=g).double()
    if n > 1:
        x["pr"][0] = x["pc"][0] - x["rc"][0] + x["rr"][0]  # h = 0
        x["rc"][1], x["rr"][1] = x["pc"][1], x["pr"][1]
    return x


def fake_model(log_probs: dict[int, torch.Tensor]) -> Any:
    """A model whose output for the input ids ``t`` carries the log-probs ``log_probs[id(t)]``."""

    def forward(input_ids: torch.Tensor, **_: Any) -> Any:
        lp = log_probs[id(input_ids)]
        zeros = torch.zeros(lp.shape, dtype=lp.dtype)
        return types.SimpleNamespace(
            log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool()
        )

    return forward


def per_token(seq_logps: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple:
    """(input_ids, completion_mask, per-token log-probs ``[n, width - 1]``): one prompt token,
    then ``lengths`` completion tokens; the sequence log-prob sits on its first token."""
    n = len(seq_logps)
    ids = torch.ones((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, k in enumerate(lengths.long().tolist()):
        mask[i, 1 : 1 + k] = 1
    lp = torch.cat([seq_logps[:, None], torch.zeros((n, width - 2), dtype=seq_logps.dtype)], 1)
    return ids, mask, lp


def stand_in(**attrs: Any) -> Any:
    acc = types.SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x
    )
    base = {
        "model": types.SimpleNamespace(training=True),
        "accelerator": acc,
        "aux_loss_enabled": False,
        "precompute_ref_logps": True,
        "_metrics": defaultdict(lambda: defaultdict(list)),
        "_total_train_tokens": 0,
        "_tp_size": 1,
    }
    return types.SimpleNamespace(**{**base, **attrs})


def trl_dpo(name: str, x: dict, beta: float, f_divergence: str = "reverse_kl", **knobs: Any):
    """TRL's DPO loss (the batch mean) of the pairs ``x``."""
    dpo = trl_module("trl.trainer.dpo_trainer")
    width = int(max(x["lc"].max(), x["lr"].max())) + 2
    ids, mask, lp = per_token(torch.cat([x["pc"], x["pr"]]), torch.cat([x["lc"], x["lr"]]), width)
    self = stand_in(
        beta=beta,
        loss_types=[name],
        loss_weights=[1.0],
        ld_alpha=None,
        f_divergence_type=f_divergence,
        f_alpha_divergence_coef=knobs.get("f_alpha", 0.5),
        label_smoothing=knobs.get("label_smoothing", 0.0),
        use_weighting=False,
        args=types.SimpleNamespace(discopop_tau=knobs.get("discopop_tau", 0.05)),
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "ref_chosen_logps": x["rc"],
        "ref_rejected_logps": x["rr"],
    }
    return dpo.DPOTrainer._compute_loss(self, fake_model({id(ids): lp}), inputs, False)


def ours(name: str, x: dict, beta: float, **knobs: Any) -> torch.Tensor:
    reference = PREFERENCE_LOSSES.info(name).get("reference", True)
    return pair_loss(
        name,
        x["pc"],
        x["pr"],
        x["rc"] if reference else None,
        x["rr"] if reference else None,
        beta=beta,
        chosen_lengths=x["lc"],
        rejected_lengths=x["lr"],
        **knobs,
    )


def check_against(trl_mean, name: str, x: dict, beta: float, per_pair: bool, **knobs: Any):
    """Batch mean and its gradient (w.r.t. the policy's log-probs), then each pair's value."""
    policy = {k: x[k].clone().requires_grad_(True) for k in ("pc", "pr")}
    ref_x = {**x, **{k: v.clone().requires_grad_(True) for k, v in policy.items()}}
    expected = trl_mean(ref_x)
    got = ours(name, {**x, **policy}, beta, **knobs).mean()
    torch.testing.assert_close(got, expected.to(got.dtype), **TOL)
    g_ref = torch.autograd.grad(expected, [ref_x["pc"], ref_x["pr"]])
    g_got = torch.autograd.grad(got, [policy["pc"], policy["pr"]])
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), **TOL)
    if per_pair:  # each pair alone (a batchwise loss sorts: its pairs are not separable)
        losses = ours(name, x, beta, **knobs)
        for i in range(len(losses)):
            one = {k: v[i : i + 1] for k, v in x.items()}
            torch.testing.assert_close(losses[i], trl_mean(one).to(losses.dtype), **TOL)


@pytest.mark.parametrize(("name", "knobs"), DPO_CASES, ids=str)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_pair_loss_matches_trl(name: str, knobs: dict, beta: float) -> None:
    x = pair_inputs(seed=hash(name) % 1000)
    batchwise = PREFERENCE_LOSSES.info(name).get("batchwise", False)
    check_against(lambda y: trl_dpo(name, y, beta, **knobs), name, x, beta, not batchwise, **knobs)


@pytest.mark.parametrize(("name", "kind"), F_CASES)
def test_f_divergence_matches_trl(name: str, kind: str) -> None:
    knobs: dict[str, Any] = {"label_smoothing": 0.1} if name in ("robust", "exo_pair") else {}
    x = pair_inputs(seed=3)
    x["pc"], x["pr"] = x["rc"] + 0.3 * (x["pc"] - x["rc"]), x["rr"] + 0.3 * (x["pr"] - x["rr"])
    check_against(
        lambda y: trl_dpo(name, y, 0.5, f_divergence=kind, **knobs),
        name,
        x,
        0.5,
        True,
        f_divergence=kind,
        **knobs,
    )


@pytest.mark.parametrize("alpha", [0.5, 1.7, 1.0])
def test_alpha_divergence(alpha: float) -> None:
    """TRL casts the α-divergence scores through float32 (its clamp table has no float64), so
    here float64 is checked against the formula and float32 against TRL."""
    rho = torch.tensor([-3.0, -0.2, 0.0, 0.4, 2.5], dtype=torch.float64)
    expected = rho if alpha == 1.0 else (torch.exp((alpha - 1) * rho) - 1) / (alpha - 1)
    torch.testing.assert_close(f_divergence_scores(rho, "alpha_divergence", alpha), expected)
    x = {k: v.float() for k, v in pair_inputs(seed=4).items()}
    x["pc"], x["pr"] = x["rc"] + 0.2 * (x["pc"] - x["rc"]), x["rr"] + 0.2 * (x["pr"] - x["rr"])
    got = ours("sigmoid", x, 0.5, f_divergence="alpha_divergence", f_alpha=alpha).mean()
    trl = trl_dpo("sigmoid", x, 0.5, f_divergence="alpha_divergence", f_alpha=alpha)
    torch.testing.assert_close(got, trl, atol=1e-6, rtol=1e-5)


def test_sigmoid_and_ipo_at_a_tie() -> None:
    """At π = π_ref (h = 0) DPO is ln 2, hinge 1, IPO (1/(2β))², SPPO 2 (1/(2β))²."""
    x = pair_inputs(4)
    x["pc"], x["pr"] = x["rc"].clone(), x["rr"].clone()
    by_name = {"sigmoid": math.log(2), "hinge": 1.0, "ipo": 1.0, "sppo_hard": 2.0, "robust": None}
    for name, value in by_name.items():
        losses = ours(name, x, 0.5, **({"label_smoothing": 0.2} if name == "robust" else {}))
        torch.testing.assert_close(losses, torch.full_like(losses, value or math.log(2)))


def test_every_trl_pair_loss_is_registered() -> None:
    config = trl_module("trl.trainer.dpo_config")
    text = config.DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    trl_names = {n.strip("`'") for n in text.split(": ", 1)[1].split(". If")[0].split(", ")}
    assert trl_names - {"sft"} <= set(PREFERENCE_LOSSES.names())
    assert {"orpo", "simpo"} <= set(PREFERENCE_LOSSES.names())


def test_empty_batch_gives_no_losses() -> None:
    x = {k: v[:0] for k, v in pair_inputs().items()}
    for name in PREFERENCE_LOSSES.names():
        knobs = {"label_smoothing": 0.1} if name == "exo_pair" else {}
        assert ours(name, x, 0.1, **knobs).shape == (0,)


# ----------------------------------------------------------------------------- reference-free


@pytest.mark.parametrize("beta", [0.1, 1.5])
def test_orpo_matches_trl_odds_ratio_loss(beta: float) -> None:
    """TRL's odds-ratio term is ``β log σ(log odds)`` (subtracted from the NLL), on the
    per-token average log-probs. It casts them to float32 first, so the check is to float32
    precision (1e-6 relative on values of order 1)."""
    orpo = trl_module("trl.experimental.orpo.orpo_trainer")
    x = pair_inputs(seed=5)
    x["pc"] = x["pc"] / 10  # averages near 0 (p near 1) exercise log1mexp's other branch
    self = types.SimpleNamespace(beta=beta, accelerator=types.SimpleNamespace(device="cpu"))
    avg = {
        k: (x[p] / x[n]).requires_grad_(True) for k, p, n in (("c", "pc", "lc"), ("r", "pr", "lr"))
    }
    trl_losses = orpo.ORPOTrainer.odds_ratio_loss(self, avg["c"], avg["r"])[0]
    pc, pr = (x["pc"].clone().requires_grad_(True), x["pr"].clone().requires_grad_(True))
    got = ours("orpo", {**x, "pc": pc, "pr": pr}, beta)
    torch.testing.assert_close(got, -trl_losses.double(), atol=1e-6, rtol=1e-6)
    gc, gr = torch.autograd.grad(-trl_losses.sum(), [avg["c"], avg["r"]])
    mc, mr = torch.autograd.grad(got.sum(), [pc, pr])  # d/d sum = d/d avg / length
    torch.testing.assert_close(mc * x["lc"], gc, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mr * x["lr"], gr, atol=1e-6, rtol=1e-5)
    assert PREFERENCE_LOSSES.info("orpo") == {"reference": False, "nll": 1.0}


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (0.1, 1.2, 0.1)])
def test_simpo_matches_trl_cpo_loss(beta: float, gamma: float, eps: float) -> None:
    cpo = trl_module("trl.experimental.cpo.cpo_trainer")
    x = pair_inputs(seed=6)
    self = types.SimpleNamespace(
        alpha=0.0,
        loss_type="simpo",
        simpo_gamma=gamma,
        beta=beta,
        label_smoothing=eps,
        accelerator=types.SimpleNamespace(device="cpu"),
    )
    avg = {
        k: (x[p] / x[n]).requires_grad_(True) for k, p, n in (("c", "pc", "lc"), ("r", "pr", "lr"))
    }
    trl_losses = cpo.CPOTrainer.cpo_loss(self, avg["c"], avg["r"])[0]
    pc, pr = (x["pc"].clone().requires_grad_(True), x["pr"].clone().requires_grad_(True))
    got = ours("simpo", {**x, "pc": pc, "pr": pr}, beta, simpo_gamma=gamma, label_smoothing=eps)
    torch.testing.assert_close(got, trl_losses, **TOL)
    gc, gr = torch.autograd.grad(trl_losses.sum(), [avg["c"], avg["r"]])
    mc, mr = torch.autograd.grad(got.sum(), [pc, pr])
    torch.testing.assert_close(mc * x["lc"], gc, **TOL)
    torch.testing.assert_close(mr * x["lr"], gr, **TOL)
    # reference-free: the reference log-probs are not read
    assert PREFERENCE_LOSSES.info("simpo")["reference"] is False
    torch.testing.assert_close(
        ours("simpo", {**x, "rc": None, "rr": None}, beta, simpo_gamma=gamma, label_smoothing=eps),
        got.detach(),
    )


# ----------------------------------------------------------------------------- KTO


def trl_kto(name: str, x: dict, beta: float, wd: float, wu: float) -> torch.Tensor:
    kto = trl_module("trl.trainer.kto_trainer")
    n = len(x["policy"])
    width = int(max(x["len"].max(), x["kl_len"].max())) + 2
    ids, mask, lp = per_token(x["policy"], x["len"], width)
    kl_ids, kl_mask, kl_lp = per_token(x["policy_kl"], x["kl_len"], width)
    self = stand_in(
        loss_type=name,
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        calculate_KL=name == "kto",
    )
    self._compute_kl_logps = types.MethodType(kto.KTOTrainer._compute_kl_logps, self)
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": mask,
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": kl_mask,
        "label": x["labels"].bool(),
        "ref_logps": x["ref"],
        "ref_KL_logps": x["ref_kl"],
    }
    assert n == len(inputs["label"])
    model = fake_model({id(ids): lp, id(kl_ids): kl_lp})
    return kto.KTOTrainer._compute_loss(self, model, inputs, False)


def unpaired_inputs(labels: list[int], seed: int, kl_shift: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = len(labels)

    def logps() -> torch.Tensor:
        return -(torch.rand(n, generator=g, dtype=torch.float64) * 20 + 0.5)

    x = {"policy": logps(), "ref": logps(), "policy_kl": logps(), "ref_kl": logps()}
    x["policy_kl"] = x["ref_kl"] + kl_shift + torch.randn(n, generator=g, dtype=torch.float64)
    x["labels"] = torch.tensor(labels)
    x["len"] = torch.randint(1, 9, (n,), generator=g).double()
    x["kl_len"] = torch.randint(1, 9, (n,), generator=g).double()
    return x


def ours_unpaired(name: str, x: dict, beta: float, wd: float, wu: float) -> torch.Tensor:
    kl = kto_kl(x["policy_kl"], x["ref_kl"]) if UNPAIRED_LOSSES.info(name).get("kl") else 0.0
    return unpaired_loss(
        name,
        x["policy"],
        x["ref"],
        x["labels"],
        kl,
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
    ).mean()


@pytest.mark.parametrize("name", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize(
    ("labels", "kl_shift", "wd", "wu"),
    [
        ([1, 0, 1, 1, 0, 0, 1], 2.0, 1.0, 1.0),  # KL estimate > 0
        ([1, 0, 1, 1, 0, 0, 1], -2.0, 1.3, 0.8),  # < 0: clamped to 0
        ([1, 1, 1, 1], 0.5, 1.0, 1.5),  # only desirable
        ([0, 0, 0], 0.5, 1.0, 1.5),  # only undesirable
        ([1], 0.5, 1.0, 1.0),  # one example
    ],
)
def test_unpaired_loss_matches_trl(name, labels, kl_shift, wd, wu) -> None:  # type: ignore[no-untyped-def]
    x = unpaired_inputs(labels, seed=len(labels), kl_shift=kl_shift)
    for beta in (0.1, 0.9):
        policy = x["policy"].clone().requires_grad_(True)
        trl_policy = x["policy"].clone().requires_grad_(True)
        expected = trl_kto(name, {**x, "policy": trl_policy}, beta, wd, wu)
        got = ours_unpaired(name, {**x, "policy": policy}, beta, wd, wu)
        torch.testing.assert_close(got, expected, **TOL)
        (g_ref,) = torch.autograd.grad(expected, [trl_policy])
        (g_got,) = torch.autograd.grad(got, [policy])
        torch.testing.assert_close(g_got, g_ref, **TOL)


def test_kto_reference_point_is_a_detached_clamped_mean() -> None:
    policy = torch.tensor([-1.0, -2.0, -4.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -2.5])
    kl = kto_kl(policy, ref)  # mean(1, 0, -1.5) < 0
    assert float(kl) == 0.0 and not kl.requires_grad
    assert float(kto_kl(policy, ref - 1)) == pytest.approx(2.5 / 3)  # mean(2, 1, -0.5)


@pytest.mark.parametrize("kind", ["reverse_kl", "js_divergence"])
def test_ipo_matches_trl_on_one_token_responses(kind: str) -> None:
    """TRL's IPO divides the log-ratios by the response lengths, treadle's follows the paper
    (sums): the two agree where every response is one token long."""
    x = pair_inputs(seed=7)
    x["lc"], x["lr"] = torch.ones(B, dtype=torch.float64), torch.ones(B, dtype=torch.float64)
    check_against(
        lambda y: trl_dpo("ipo", y, 0.3, f_divergence=kind), "ipo", x, 0.3, True, f_divergence=kind
    )
