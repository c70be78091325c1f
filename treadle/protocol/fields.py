"""The standard fields of one RL step: the batch contract, written down once.

Standard fields of one RL step (B = batch, P = prompt length, R = response length)::

    key                   shape    what                                     added by
    prompts               [B, P]   prompt token ids, left-padded            data
    prompt_mask           [B, P]   1 on real prompt tokens                  data
    responses             [B, R]   response token ids, right-padded         rollout
    response_mask         [B, R]   1 on positions that count (the only      rollout
                                   source of truth; tool output is 0)
    response_attention_mask [B, R] 1 on every real response token, tool     rollout
                                   output included; present only when it
                                   differs from response_mask (agent loops)
    rollout_log_probs     [B, R]   log-probs from the rollout engine        rollout
    old_log_probs         [B, R]   log-probs of the policy before update    actor
    sum_pi_squared        [B, R]   Σ_v π(v)² of the old policy per token    actor
                                   (optimal token baseline only)
    ref_log_probs         [B, R]   log-probs of the frozen reference        reference
    teacher_log_probs     [B, R]   log-probs of the distillation teacher    teacher
    teacher_topk_ids      [B, R, K] the teacher's K most likely ids, most   teacher
                                   likely first (0 where not counted)
    teacher_topk_log_probs [B, R, K] their log-probs (0 where not counted)  teacher
    values                [B, R]   critic values (PPO)                      critic
    token_level_rewards   [B, R]   reward per token (usually at the end)    reward
    reward_components     [B, K]   named parts of the reward, in the order  reward
                                   of algorithm.gdpo_reward_keys (GDPO)
    advantages            [B, R]   advantage estimates                      algorithm
    returns               [B, R]   value targets                            algorithm
    uid                   [B]      object: prompt id, shared by a group     data
    prompt_text           [B]      object: the prompt as text               data
    response_text         [B]      object: the decoded response             rollout
    ground_truth          [B]      object: what the reward compares with    data
    stop_reason           [B]      object: why generation stopped           rollout

`STANDARD_SHAPES` holds the same table for code: a phase states what it reads with
``batch.check({k: STANDARD_SHAPES[k] for k in ("responses", "response_mask")})``, which fails
with the name of a missing key or of the key whose dimension disagrees with the others that
share the dimension's name.
"""

from __future__ import annotations

_RESPONSE = ("batch", "response")
_PER_SAMPLE = ("batch",)

STANDARD_SHAPES: dict[str, tuple[str, ...]] = {
    "prompts": ("batch", "prompt"),
    "prompt_mask": ("batch", "prompt"),
    "responses": _RESPONSE,
    "response_mask": _RESPONSE,
    "response_attention_mask": _RESPONSE,
    "rollout_log_probs": _RESPONSE,
    "old_log_probs": _RESPONSE,
    "sum_pi_squared": _RESPONSE,
    "ref_log_probs": _RESPONSE,
    "teacher_log_probs": _RESPONSE,
    "teacher_topk_ids": (*_RESPONSE, "topk"),
    "teacher_topk_log_probs": (*_RESPONSE, "topk"),
    "values": _RESPONSE,
    "token_level_rewards": _RESPONSE,
    "advantages": _RESPONSE,
    "returns": _RESPONSE,
    "uid": _PER_SAMPLE,
    "prompt_text": _PER_SAMPLE,
    "response_text": _PER_SAMPLE,
    "ground_truth": _PER_SAMPLE,
    "stop_reason": _PER_SAMPLE,
}
"""Shape names of the standard fields, for `Batch.check`."""
