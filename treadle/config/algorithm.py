"""``algorithm``: the advantage estimator, the policy loss, KL and the rest of RL's maths.

The YAML keys are flat (``algorithm.clip_cov_ratio``), as the algorithm registries name them
(a loss is registered with ``knobs=(...)``, the keys it reads, and receives them as keywords).
In code they are grouped by what reads them: one small settings class per estimator or loss
family, documented in its own table of ``docs/config.md``; ``AlgorithmConfig`` is all of them
plus the selectors. ``SETTINGS`` names them in the order the reference lists them, and
``AlgorithmConfig.settings(name)`` gives the values of one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from treadle.config.base import Key, Section


class EstimatorChoice(Section):
    """The advantage estimator; the next tables are the settings of the estimators."""

    adv_estimator: str = Field("grpo", description="Advantage estimator, by registered name.")


class GroupSettings(Section):
    """Group-baseline estimators (grpo and its relatives): how a group's rewards are normalized."""

    norm_adv_by_std: bool = Field(True, description="GRPO: divide by the group std.")


class DiscountSettings(Section):
    """Estimators that discount along the response (gae, reinforce_plus_plus)."""

    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor (GAE, REINFORCE++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")


class GDPOSettings(Section):
    """GDPO (``adv_estimator=gdpo``): the reward's named components, each normalized on its own."""

    gdpo_reward_keys: list[Key] = Field(
        default_factory=list,
        description="GDPO (adv_estimator=gdpo, which needs them): the reward's components to "
        "normalize each on its own within the group, in order; the reward function returns a "
        "dict of named numbers (its score is their sum) that holds these keys.",
    )
    gdpo_reward_weights: list[float] | None = Field(
        None,
        description="GDPO: the weight of each gdpo_reward_keys component in the advantage; "
        "null: 1 each.",
    )

    @model_validator(mode="after")
    def _one_weight_per_gdpo_key(self) -> GDPOSettings:
        w, keys = self.gdpo_reward_weights, self.gdpo_reward_keys
        if w is not None and len(w) != len(keys):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(w)} weights for {len(keys)} "
                f"algorithm.gdpo_reward_keys ({keys}): give one weight per key"
            )
        if len(set(keys)) != len(keys):
            raise ValueError(f"algorithm.gdpo_reward_keys lists a key twice: {keys}")
        return self


class PolicyLossChoice(Section):
    """The policy loss; the next tables are the settings of the losses (and their aggregation)."""

    policy_loss: str = Field("ppo", description="Policy loss, by registered name.")


class ClipSettings(Section):
    """PPO's clipped ratio: read by ppo, gspo, cispo, clip_cov, geo_mean and bypass_mode
    (their ``knobs``)."""

    clip_ratio_low: float = Field(
        0.2, ge=0, lt=1, description="PPO clip: lower bound 1 - low (below 1: a ratio is > 0)."
    )
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip: upper bound 1 + high.")
    clip_ratio_c: float | None = Field(
        3.0,
        gt=1,
        description="Dual-clip constant c > 1 (Ye et al., arXiv 1912.09729): a token with "
        "A < 0 loses at most -A*c however large its ratio; null: off. 3.0, verl's and the "
        "paper's value: it only binds off-policy (ratio > c), where PPO's clip leaves the loss "
        "of a negative-advantage token unbounded, and keeps 'ppo' equal to verl's 'vanilla'. "
        "Also the ppo_clip loss of bypass_mode.",
    )


class ClipCovSettings(Section):
    """Policy loss clip_cov (Cui et al., the entropy mechanism): which tokens lose their
    gradient."""

    clip_cov_ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="clip_cov: fraction of the valid tokens (at least one) whose gradient is "
        "dropped, chosen at random among the candidates (the paper's and verl's 2e-4).",
    )
    clip_cov_lb: float = Field(
        1.0, description="clip_cov: candidates have a covariance above this (paper, verl: 1)."
    )
    clip_cov_ub: float = Field(
        5.0, description="clip_cov: candidates have a covariance below this (paper, verl: 5)."
    )

    @model_validator(mode="after")
    def _a_band(self) -> ClipCovSettings:
        if self.clip_cov_lb >= self.clip_cov_ub:  # no token a candidate: plain PPO, silently
            raise ValueError(
                f"algorithm.clip_cov_lb={self.clip_cov_lb:g} must be below "
                f"algorithm.clip_cov_ub={self.clip_cov_ub:g} (no covariance lies between them)"
            )
        return self


class KLCovSettings(Section):
    """Policy loss kl_cov: which tokens get the |log-ratio| penalty, and its weight."""

    kl_cov_ratio: float = Field(
        2e-4,
        gt=0,
        le=1,
        description="kl_cov: fraction of the valid tokens (at least one), those of largest "
        "covariance, that get the |log-ratio| penalty (verl's 2e-4; the paper's recipe uses "
        "2e-3 for 7B models).",
    )
    kl_cov_coef: float = Field(
        1.0,
        ge=0,
        description="kl_cov: weight of the |log-ratio| penalty. 1, as in the paper's recipe "
        "(ppo_kl_coef=1) and verl's function fallback; verl's PolicyLossConfig default is 0.1.",
    )


class SAPOSettings(Section):
    """Policy loss sapo: the soft gate's temperatures."""

    sapo_tau_pos: float = Field(
        1.0, gt=0, description="sapo: gate temperature for A > 0 (the paper's and verl's 1.0)."
    )
    sapo_tau_neg: float = Field(
        1.05, gt=0, description="sapo: gate temperature for A <= 0 (the paper's and verl's 1.05)."
    )


class DROSettings(Section):
    """Policy loss dro: the weight of its squared log-ratio penalty."""

    dro_beta: float | None = Field(
        None,
        gt=0,
        description="dro: weight of the 0.5 * (log pi - log pi_old)^2 penalty; required with "
        "policy_loss=dro (no default, as in verl: the paper tunes it).",
    )


class DPPOSettings(Section):
    """Policy losses dppo_tv and dppo_kl: divergence thresholds and the ratio cap."""

    dppo_divergence_low: float = Field(
        0.2,
        gt=0,
        description="dppo_tv / dppo_kl: divergence threshold for tokens with A <= 0 (verl "
        "reads clip_ratio_low for it; 0.2 is that default).",
    )
    dppo_divergence_high: float = Field(
        0.2,
        gt=0,
        description="dppo_tv / dppo_kl: divergence threshold for tokens with A > 0 (verl "
        "reads clip_ratio_high for it; 0.2 is that default).",
    )
    dppo_is_cap: float = Field(
        20.0,
        gt=1,
        description="dppo_tv / dppo_kl: truncation of the importance ratio that weights the "
        "gradient. 20: the paper asks for a large cap (its Section 5.4) and verl's loss falls "
        "back to 20, though verl passes its clip_ratio_c (3.0) when set.",
    )


class BypassSettings(Section):
    """Policy loss bypass_mode (the rollout log-probs are the old policy)."""

    bypass_loss_type: Literal["ppo_clip", "reinforce"] = Field(
        "ppo_clip",
        description="bypass_mode (the rollout log-probs are the old policy): 'ppo_clip' clips "
        "r = pi / pi_rollout as PPO; 'reinforce' is -w*A*log pi with truncated weights w.",
    )
    bypass_is: Literal["none", "token", "sequence"] = Field(
        "token",
        description="bypass_mode with reinforce: importance weight pi / pi_rollout per token "
        "or per sequence (product over its tokens), or none. verl's default is sequence; "
        "token has far lower variance on long responses.",
    )
    bypass_is_cap: float = Field(
        2.0, gt=0, description="bypass_mode with reinforce: truncation of the weights (verl: 2)."
    )


class AggregationSettings(Section):
    """How token losses become one number (``loss_agg_mode`` and its knob)."""

    loss_agg_mode: str = Field("token-mean", description="How token losses become one number.")
    loss_scale_factor: float | None = Field(
        None,
        gt=0,
        description="seq-mean-token-sum-norm: the constant each sequence's token sum is "
        "divided by; null: the micro-batch's padded response length (verl's default), which "
        "changes with the batch; set e.g. rollout.max_new_tokens for a fixed one.",
    )


class KLSettings(Section):
    """KL to the reference: as a loss term and as a penalty in the reward."""

    kl_coef: float = Field(0.001, ge=0, description="KL-to-reference loss weight; 0 drops ref.")
    kl_estimator: str = Field("k3", description="KL estimator, by registered name.")
    kl_reward_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty in the reward: r_t = score_t - coef * KL_t (InstructGPT); "
        "the initial coefficient when kl_target is set; 0 disables.",
    )
    kl_reward_estimator: str = Field("k1", description="KL estimator of the reward penalty.")
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL in the reward (Ziegler et al.): steer the coefficient so the "
        "KL approaches this; null keeps kl_reward_coef fixed.",
    )
    kl_horizon: int = Field(10_000, gt=0, description="Adaptive KL: horizon, in samples.")


class DynamicSamplingSettings(Section):
    """DAPO's dynamic sampling and overlong filtering."""

    filter_groups: bool = Field(
        False,
        description="DAPO dynamic sampling: drop groups whose rewards are all equal and "
        "generate more prompts until data.batch_size groups remain.",
    )
    max_gen_rounds: int = Field(
        4,
        gt=0,
        description="Dynamic sampling: generation rounds per step at most; when they do not "
        "fill the batch it is topped up with equal-reward groups (zero advantage).",
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO overlong filtering: responses cut at rollout.max_new_tokens do not "
        "count in the policy loss.",
    )


class RolloutCorrectionSettings(Section):
    """Correcting the gap between the policy that sampled and the learner's old policy."""

    rollout_correction: Literal["none", "tis", "mis"] = Field(
        "none",
        description="Correct the gap between the policy that sampled (rollout log-probs: stale "
        "weights in async modes, another engine or dtype) and the learner's old policy, per "
        "token: 'tis' weights the policy-gradient term by min(ratio, cap) (truncated importance "
        "sampling), 'mis' by the ratio where it is at most the cap and drops tokens above it "
        "from the loss (masked importance sampling); ratio = pi_old / pi_rollout.",
    )
    rollout_correction_cap: float = Field(
        2.0, gt=1, description="The cap of algorithm.rollout_correction (tis, mis)."
    )


SETTINGS: dict[str, type[Section]] = {
    "group": GroupSettings,
    "discount": DiscountSettings,
    "gdpo": GDPOSettings,
    "clip": ClipSettings,
    "clip_cov": ClipCovSettings,
    "kl_cov": KLCovSettings,
    "sapo": SAPOSettings,
    "dro": DROSettings,
    "dppo": DPPOSettings,
    "bypass": BypassSettings,
    "aggregation": AggregationSettings,
    "kl": KLSettings,
    "dynamic_sampling": DynamicSamplingSettings,
    "rollout_correction": RolloutCorrectionSettings,
}
"""The settings classes of ``algorithm``, by name (``ClipCovSettings``: ``clip_cov``)."""


class AlgorithmConfig(
    RolloutCorrectionSettings,
    DynamicSamplingSettings,
    KLSettings,
    AggregationSettings,
    BypassSettings,
    DPPOSettings,
    DROSettings,
    SAPOSettings,
    KLCovSettings,
    ClipCovSettings,
    ClipSettings,
    PolicyLossChoice,
    GDPOSettings,
    DiscountSettings,
    GroupSettings,
    EstimatorChoice,
):
    """The RL algorithm: the advantage estimator and the policy loss (by registered name), the
    settings each reads, KL, dynamic sampling and rollout correction. The keys sit flat in
    this section; the tables below group them by what reads them."""

    entropy_coef: float = Field(0.0, description="Entropy bonus weight.")
    plugins: list[Key] = Field(
        default_factory=list,
        description="Python modules ('my_package.estimators') or files ('path/to/file.py') "
        "imported before any registered name is resolved, by the driver and every worker: "
        "where your @register_adv_estimator (policy loss, KL estimator...) functions live. A "
        "file path is made absolute.",
    )

    @field_validator("plugins")
    @classmethod
    def _absolute_plugin_files(cls, value: list[str]) -> list[str]:
        # workers import them too, and a worker's working directory may not be the driver's
        return [str(Path(p).absolute()) if p.endswith(".py") else p for p in value]

    def settings(self, name: str) -> Section:
        """The values of the settings class ``name`` (a key of ``SETTINGS``) in this section."""
        cls = SETTINGS[name]
        return cls.model_validate({key: getattr(self, key) for key in cls.model_fields})
