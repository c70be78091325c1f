"""A custom agent loop, run by path: the model answers, the calculator checks, the model corrects.

    rollout:
      agent_loop: examples/tools/check_loop.py:answer_then_check
      tools: [treadle.tasks.calculator:calculator]

Turn 1: the model answers the question. The loop then finds the arithmetic in the question,
asks the ``calculator`` tool for it, and tells the model what the calculator says (an
environment message: loss mask 0). Turn 2: the model gives its final answer, which the reward
reads. Every trajectory has two model turns, whatever the model writes.
"""

from __future__ import annotations

import re

from treadle.agents import AgentClient, Sample, Toolbox, ToolCall, Trajectory

_EXPRESSION = re.compile(r"\d+(?:\s*[-+*/]\s*\d+)+")


async def answer_then_check(client: AgentClient, sample: Sample, tools: Toolbox) -> Trajectory:
    t = Trajectory(list(sample.prompt_ids))
    first = await client.generate(t.all_token_ids)
    t.add_response(first)
    found = _EXPRESSION.search(sample.prompt_text)
    expression = found.group(0) if found else sample.prompt_text
    result = await tools.call(ToolCall("calculator", {"expression": expression}))
    note = {
        "role": "user",
        "content": f"The calculator says {expression} = {result.content}. "
        "Check your answer and give the final one.",
    }
    t.add_tokens(client.encode_messages([note], after=first.token_ids))
    second = await client.generate(
        t.all_token_ids, min(client.params.max_new_tokens, client.remaining(t))
    )
    t.add_response(second)
    t.response_text = client.decode(second.token_ids)
    t.info["calculator_errors"] = int(result.error)
    return t
