"""Every cross-field rule of a run's config, in one place.

Three readers, one set of rules, all imported from here:

- config validation (``Config``, at load): ``config_problems`` and ``old_log_probs_problem``,
  the rules between sections that need nothing but the config;
- ``treadle check`` and the trainers' start (``check_algorithm``): registered names (after
  ``algorithm.plugins`` are imported) and the rules that need the registries' facts: a group
  baseline needs ``rollout.n >= 2``, a loss may allow only some ``loss_agg_mode`` values, a knob
  no chosen function reads is an error; for ``train`` also the roles' rules below; for sft,
  dpo, kto and rm, every setting they never read (RL's, another command's section) set away
  from its default (``unread_settings``);
- role selection (``uses_critic``, ``uses_prm``): whether the run has a critic or PRIME's
  PRM, refusing a config that contradicts the estimator (``role_problems``, which
  ``check_algorithm`` runs for ``train``, holds the same rules, so ``treadle check`` says it
  first);
- the value models' folders (``check_value_models``: the critic's and reward model's share the
  actor's vocabulary, the reward model is one), read from their config.json files alone, for
  ``treadle check`` and the trainers' role plan.

Every rule returns (or raises) a message that names the keys to change. The rules know the
algorithm registries and the model folders (the layers below config) and nothing above it.

One module per job, lowest first: ``commands`` (the commands, ``Kind``, and the settings each
never reads), ``placement`` (replicas, side roles, parallel layouts), ``sections`` (config
validation), ``roles`` (role selection, the teacher, the value models), ``registered``
(``check_algorithm``: names and the registries' rules).
"""

from treadle.config.rules.commands import (
    KINDS,
    NOT_RL,
    RL_KINDS,
    Kind,
    evaluates_sets,
    unread_settings,
)
from treadle.config.rules.placement import model_problems, parallel_model_problems
from treadle.config.rules.registered import check_algorithm, vision_language_problems
from treadle.config.rules.roles import check_value_models, role_problems, uses_critic, uses_prm
from treadle.config.rules.sections import config_problems, old_log_probs_problem

__all__ = [
    "KINDS",
    "NOT_RL",
    "RL_KINDS",
    "Kind",
    "check_algorithm",
    "check_value_models",
    "config_problems",
    "evaluates_sets",
    "model_problems",
    "old_log_probs_problem",
    "parallel_model_problems",
    "role_problems",
    "unread_settings",
    "uses_critic",
    "uses_prm",
    "vision_language_problems",
]
