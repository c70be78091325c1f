"""A two-turn agent written with the `openai` client alone: answer, then check.

    rollout:
      agent_loop: openai:examples/openai_agent/agent.py:answer_then_check

Turn 1 asks the question of the data row (its ``prompt``). Turn 2 asks the model to check its
work and give the final answer, which is scored against the row's ``answer``. Nothing here
imports treadle: the same function runs against any OpenAI-compatible server (`treadle serve`,
vLLM, a hosted API).
"""

from __future__ import annotations

import re

import openai

MODEL = "policy"  # the name is not checked: the endpoint serves the run's model
CHECK = "Check your answer. Reply with the final answer as: Answer: <number>"
_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


async def answer_then_check(client: openai.AsyncOpenAI, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48)
    messages.append({"role": "assistant", "content": first.choices[0].message.content or ""})
    messages.append({"role": "user", "content": CHECK})
    second = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48)
    final = _ANSWER.findall(second.choices[0].message.content or "")
    return 1.0 if final and final[-1] == str(row["answer"]) else 0.0
