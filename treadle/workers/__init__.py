"""Role workers: SPMD programs over the engines, one module per role.

=======================  ===================================================================
module                   what it holds
=======================  ===================================================================
:mod:`.base`             :class:`~.base.RoleWorker`: the opening every worker shares
                         (threads, device, process group, config); :class:`~.base.
                         TrainingWorker`: the checkpoints of a trained engine
:mod:`.actor`            :class:`ActorRolloutRefWorker`: the policy (actor + rollout engine +
                         reference, colocated): log-probs, one update
:mod:`.sender`           :class:`~.sender.SendsWeights`: the policy's weights to its rollout
                         (colocated in memory, split over the weight-sync group)
:mod:`.objectives`       what the policy trains on: PPO's family, SFT, DPO's, KTO; the one
                         update loop
:mod:`.critic`           :class:`CriticWorker`: PPO's value model
:mod:`.reward_model`     :class:`RewardModelWorker` (RL scores), :class:`RewardTrainerWorker`
:mod:`.prm`              :class:`~.prm.ImplicitPRMWorker`: PRIME's implicit process reward model
:mod:`.common`           engine settings, batch layouts, sequence scores, micro-batch planning
=======================  ===================================================================

Every method is declared with :func:`~treadle.controller.register`: how its input is spread
over ranks and gathered, and the batch fields it reads (only those cross to the ranks). Each
module's docstring tables what its methods read and return.
"""

from treadle.workers.actor import ActorRolloutRefWorker
from treadle.workers.common import (
    actor_optimizer,
    engine_options,
    global_sums,
    micro_batches,
    pair_sequences,
    ppo_steps,
    prompt_response,
    value_engine,
)
from treadle.workers.critic import CriticWorker
from treadle.workers.reward_model import RewardModelWorker, RewardTrainerWorker

__all__ = [
    "ActorRolloutRefWorker",
    "CriticWorker",
    "RewardModelWorker",
    "RewardTrainerWorker",
    "actor_optimizer",
    "engine_options",
    "global_sums",
    "micro_batches",
    "pair_sequences",
    "ppo_steps",
    "prompt_response",
    "value_engine",
]
