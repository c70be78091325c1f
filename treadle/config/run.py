"""The sections of a run, composed, and what is derived from several of them."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from treadle.config.actor import ActorConfig
from treadle.config.algorithm import AlgorithmConfig
from treadle.config.asynchronous import AsyncConfig
from treadle.config.base import Section, defaults
from treadle.config.critic import CriticConfig
from treadle.config.data import DataConfig
from treadle.config.distill import DistillConfig, TeacherConfig
from treadle.config.dpo import DPOConfig
from treadle.config.evaluation import EvalConfig
from treadle.config.kto import KTOConfig
from treadle.config.model import ModelConfig
from treadle.config.prime import PrimeConfig
from treadle.config.reward import RewardConfig
from treadle.config.rollout import RolloutConfig
from treadle.config.trainer import TrainerConfig


class Sections(Section):
    """Every section of a run, and the values derived from several of them. ``Config`` adds
    the cross-field rules (``treadle.config.rules``) on top."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    model: ModelConfig = Field(default_factory=defaults(ModelConfig))
    data: DataConfig = Field(default_factory=defaults(DataConfig))
    rollout: RolloutConfig = Field(default_factory=defaults(RolloutConfig))
    reward: RewardConfig = Field(default_factory=defaults(RewardConfig))
    algorithm: AlgorithmConfig = Field(default_factory=defaults(AlgorithmConfig))
    dpo: DPOConfig = Field(default_factory=defaults(DPOConfig))
    kto: KTOConfig = Field(default_factory=defaults(KTOConfig))
    actor: ActorConfig = Field(default_factory=defaults(ActorConfig))
    critic: CriticConfig = Field(default_factory=defaults(CriticConfig))
    prime: PrimeConfig = Field(default_factory=defaults(PrimeConfig))
    teacher: TeacherConfig = Field(default_factory=defaults(TeacherConfig))
    distill: DistillConfig = Field(default_factory=defaults(DistillConfig))
    trainer: TrainerConfig = Field(default_factory=defaults(TrainerConfig))
    eval: EvalConfig = Field(default_factory=defaults(EvalConfig))
    async_: AsyncConfig = Field(default_factory=defaults(AsyncConfig), alias="async")

    def needs_old_log_prob_pass(self) -> bool:
        """Whether RL computes the old log-probs before the update (``actor.recompute_...``)."""
        a = self.actor
        needed = (
            a.ppo_epochs > 1
            or a.ppo_mini_batch_size < self.data.batch_size * self.rollout.n
            or self.algorithm.kl_reward_coef > 0
        )
        return needed if a.recompute_old_log_probs is None else a.recompute_old_log_probs

    def response_length(self) -> int:
        """Tokens after the prompt a sample may have: ``rollout.max_new_tokens`` for one turn
        (or ``eval.max_new_tokens`` when longer); for an agent loop
        ``rollout.max_response_length`` or its default."""
        r = self.rollout
        if r.agent_loop == "single_turn":
            return max(r.max_new_tokens, self.eval.max_new_tokens or 0)
        if r.max_response_length is not None:
            return r.max_response_length
        return r.max_turns * (r.max_new_tokens + r.max_tool_response_tokens)

    def rollout_replicas(self) -> int:
        """How many rollout replicas the run has (``rollout.replicas`` resolved)."""
        r = self.rollout
        if r.replicas is not None:
            return r.replicas
        return self.actor.world_size if r.placement == "colocated" else 1
