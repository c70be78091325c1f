"""Every chat template TRL keeps a copy of as its model ships it (41: Qwen2.5-3.8, gpt-oss,
Gemma 1-4, Llama 3-3.2, DeepSeek, GLM 4.5, Phi-3, LFM2, Nemotron 3, Cohere, SmolVLM...), on
the tiny tokenizer with the template's special tokens: a prompt row, a prompt/response SFT
row, a multi-turn SFT row, tool results appended by the agent loops and a tool conversation
through the endpoint each keep the user's text and the results."""

from __future__ import annotations

import json

import pytest
from tiny_models import shipped_style, shipped_templates

from treadle.agents.loops import AgentClient, Limits
from treadle.agents.tools import ToolCall, numbered, result_messages
from treadle.data import TextOptions, load_prompt_dataset, load_sft_dataset
from treadle.data.templating import end_of_turn
from treadle.engines.inference import SamplingParams
from treadle.models.loading import load_tokenizer
from treadle.runtime.errors import DataError
from treadle.serving.completions import chat_prompt_ids

# Templates whose multi-turn rows are refused, and why: gpt-oss's closes an earlier turn with
# <|end|> and the last with <|return|> (the token the model stops at); GLM 4.5's writes no
# token after a turn.
NO_MULTI_TURN_SFT = {"gptoss", "glm4moe"}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1+2?"},
    {"role": "assistant", "content": "Answer: 3"},
    {"role": "user", "content": "And 3+4?"},
    {"role": "assistant", "content": "Answer: 7"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def files(tiny_task, tmp_path_factory):
    out = tmp_path_factory.mktemp("rows")
    row = {"prompt": "What is 1+2?", "answer": "3", "solution": "Answer: 3"}
    (out / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (out / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    return {
        "tok": load_tokenizer(tiny_task["model"]),
        "rows": out / "rows.jsonl",
        "chat": out / "chat.jsonl",
    }


def test_they_are_all_here():
    names = set(shipped_templates())
    assert len(names) == 41 and names >= NO_MULTI_TURN_SFT  # (TRL 1.16's)


@pytest.mark.parametrize("name", shipped_templates())
def test_a_shipped_template_keeps_the_text_and_the_results(files, name: str) -> None:
    tok = shipped_style(files["tok"], name)
    options = TextOptions(max_prompt_length=4096, max_length=4096)
    prompt = tok.decode(load_prompt_dataset([str(files["rows"])], tok, options)[0]["prompt_ids"])
    assert "What is 1+2?" in prompt
    end = end_of_turn(tok)[1]
    row = load_sft_dataset([str(files["rows"])], tok, options)[0]
    target = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert tok.decode(target) == f"Answer: 3{end}"
    if name in NO_MULTI_TURN_SFT:
        with pytest.raises(DataError, match="does not write the conversation's assistant turns"):
            load_sft_dataset([str(files["chat"])], tok, options)
    else:
        row = load_sft_dataset([str(files["chat"])], tok, options)[0]
        target = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert tok.decode(target).replace(" Answer", "Answer") == f"Answer: 3{end}Answer: 7{end}"
    # the tools loop's results after a call turn the model ended as the template ends a turn
    client = AgentClient(None, tok, SamplingParams(), Limits(), "s")  # type: ignore[arg-type]
    calls = numbered([ToolCall("add", {"a": 1})])
    ids = client.encode_messages(
        result_messages(tok, ["42"], calls), after=[5, end_of_turn(tok)[0]], calls=calls
    )
    assert "42" in tok.decode(ids)
    # an OpenAI client's conversation with a call and its result, through the endpoint
    call = {
        "id": "abcdefghi",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
    history = [
        *CHAT[:2],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "abcdefghi", "name": "add"},
    ]
    sent = tok.decode(chat_prompt_ids(tok, history, TOOLS))
    assert "42" in sent.split("What is 1+2?")[1]
