"""A plug-in: an advantage estimator of your own, registered by name.

``algorithm.plugins: [examples/plugins/my_estimator.py]`` imports this file (in the driver and
in every worker) before any name is resolved, so ``algorithm.adv_estimator: my_baseline``
finds it: ``treadle train examples/plugins/grpo.yaml``. A module on ``sys.path`` works too
(``algorithm.plugins: [my_package.estimators]``).
"""

from treadle.algorithms import EstimatorInputs, NoSettings, register_adv_estimator


@register_adv_estimator("my_baseline")
def my_baseline(inputs: EstimatorInputs, settings: NoSettings):
    """Each response's score minus the batch's mean score, on every response token."""
    mask = inputs.response_mask
    score = (inputs.token_level_rewards * mask).sum(-1)
    adv = (score - score.mean())[:, None] * mask
    return adv, adv
