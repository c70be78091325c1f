"""Agent loops, tools and trajectories: parsing, tool calls, loss masks token by token, bounds.

The model is a scripted replica here (a test double behind the real client and loops); the
end-to-end runs on the tiny model are in tests/rollout/test_agents_e2e.py.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch
from tiny_models import chat_style, shipped_style

from treadle.agents.loops import (
    AgentLoopError,
    Limits,
    Sample,
    run_agents,
    single_turn,
    tool_loop,
)
from treadle.agents.registry import load_agent_loop
from treadle.agents.tools import (
    Tool,
    Toolbox,
    ToolCall,
    call_parser,
    numbered,
    parse_tool_calls,
    result_messages,
    tool_schema,
)
from treadle.agents.trajectory import Trajectory
from treadle.data import HERMES_TOOLS_PROMPT, tool_messages
from treadle.data.templating import end_of_turn, render
from treadle.engines.inference import SamplingParams
from treadle.runtime.errors import ConfigError
from treadle.serving.client import RolloutClient
from treadle.serving.server import Request, Response
from treadle.trainers.rl import outcome_rewards


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"no luck with {x}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def nap(seconds: float) -> str:
    """Sleeps, asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"


def toolbox(timeout_s: float = 5.0) -> Toolbox:
    return Toolbox([Tool(f.__name__, f, tool_schema(f)) for f in (add, boom, slow, nap)], timeout_s)


# ----------------------------------------------------------------------------- tool calls


def test_parse_tool_calls_takes_every_block_and_names_what_is_wrong():
    text = (
        'think <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "add"'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert calls[1] == ToolCall("add", {"a": 3, "b": 4})  # arguments sent as a JSON string
    assert "not valid JSON" in calls[2].error
    assert '{"name": <tool name>' in calls[3].error
    assert "must be a JSON object" in calls[4].error
    assert calls[5].error == "the <tool_call> block is not closed"
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("I reply within <tool_call></tool_call> tags.") == []


def test_tool_calls_never_raise_errors_become_messages():
    box = toolbox(timeout_s=0.3)

    async def calls():
        return await asyncio.gather(
            box.call(ToolCall("add", {"a": 2, "b": 40})),
            box.call(ToolCall("nope", {})),
            box.call(ToolCall("boom", {"x": 7})),
            box.call(ToolCall("add", {"a": 1})),
            box.call(ToolCall("slow", {"seconds": 2.0})),
            box.call(ToolCall("nap", {"seconds": 2.0})),
            box.call(ToolCall(None, {}, "the tool call is not valid JSON (x)")),
        )

    ok, unknown, raised, missing, slow_sync, slow_async, bad = asyncio.run(calls())
    box.close()
    assert (ok.content, ok.error) == ("42", False)
    assert unknown.error and unknown.content == (
        "Error: unknown tool 'nope' (tools: add, boom, slow, nap)"
    )
    assert raised.content == "Error: boom raised RuntimeError: no luck with 7"
    assert missing.error and missing.content.startswith("Error: add raised TypeError")
    assert slow_sync.content == slow_async.content.replace("nap", "slow")
    assert slow_async.content == "Error: nap timed out after 0.3 s"
    assert slow_sync.seconds < 1.0 and slow_async.seconds < 1.0
    assert bad.content == "Error: the tool call is not valid JSON (x)"


def test_a_tool_without_docstring_args_is_a_config_error(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text("def f(x):\n    return x\n")
    with pytest.raises(ConfigError, match=r"rollout.tools: tool 'f' needs type hints"):
        Toolbox.load([f"{path}:f"])
    with pytest.raises(ConfigError, match="has no function 'g'"):
        Toolbox.load([f"{path}:g"])


def test_schemas_go_into_the_system_message_without_template_support(tiny_task):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_task["model"])
    schema = tool_schema(add)
    user = [{"role": "user", "content": "hi"}]
    messages, kwargs = tool_messages(tok, user, [schema])
    assert kwargs == {} and messages[1] == user[0]
    assert messages[0]["role"] == "system"
    assert '"name": "add"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    with_system, _ = tool_messages(
        tok, [{"role": "system", "content": "Be brief."}, *user], [schema]
    )
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools")
    assert HERMES_TOOLS_PROMPT.split("{tools}")[0] in with_system[0]["content"]


# ----------------------------------------------------------------------------- loops


class ScriptedReplica:
    """Answers each request with the next scripted text (+ the template's end-of-turn token,
    the tokenizer's EOS on ChatML, or the token a ``(text, token)`` item names), log-prob -0.25
    per token."""

    def __init__(self, tok, script: list[str], eos: bool = True) -> None:
        self.name, self.tok, self.script = "scripted", tok, list(script)
        self.eos = eos  # False: every turn is cut by its length
        self.end = end_of_turn(tok)[0]
        self.calls: list[list[Request]] = []

    async def generate(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        out = []
        for r in requests:
            text, end = self.script.pop(0), self.end
            if isinstance(text, tuple):
                text, end = text[0], self.tok.convert_tokens_to_ids(text[1])
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
            ids = [*ids, end] if self.eos else ids
            ids = ids[: r.params.max_new_tokens]
            stop = "length" if len(ids) == r.params.max_new_tokens or not self.eos else "stop"
            out.append(Response(r.request_id, ids, [-0.25] * len(ids), stop, 3, self.name))
        return out


def run_loop(
    tok,
    script,
    loop=tool_loop,
    limits=None,
    copies=1,
    samples=None,
    eos=True,
    max_new_tokens=120,
    parse_calls=parse_tool_calls,
):
    replica = ScriptedReplica(tok, script, eos)
    client = RolloutClient([replica])
    question = [{"role": "user", "content": "What is 2+40?"}]
    prompt = tok(render(tok, question, generation=True), add_special_tokens=False)["input_ids"]
    samples = samples or [Sample("u:1", prompt, "What is 2+40?", "42", {})]
    params = SamplingParams(n=copies, max_new_tokens=max_new_tokens)
    limits = limits or Limits(4, 600, 32)
    runs = client.run(
        run_agents(
            loop,
            client,
            samples,
            copies,
            params,
            tokenizer=tok,
            tools=toolbox(),
            limits=limits,
            max_concurrent=8,
            parse_calls=parse_calls,
        )
    )
    client.close()
    return [t for _, t in runs.rows()], replica


@pytest.fixture(scope="module")
def tok(tiny_task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_task["model"])


def test_tool_loop_loss_mask_token_by_token(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    (t,), replica = run_loop(tok, [call, "Answer: 42"])
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    turn1, turn2 = [*enc(call), eos], [*enc("Answer: 42"), eos]
    # What follows the model's <|im_end|>: ChatML's newline, the tool message, the next header.
    between = enc(
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert t.token_ids == turn1 + between + turn2
    assert t.loss_mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert t.log_probs == [-0.25] * len(turn1) + [0.0] * len(between) + [-0.25] * len(turn2)
    assert (t.turns, t.stop_reason, t.response_text) == (2, "stop", "Answer: 42")
    assert t.info == {"tool_calls": 1, "tool_errors": 0, "tool_seconds": pytest.approx(0, abs=0.5)}
    # Turn 2 was asked to continue exactly the conversation so far (token-in, token-out).
    second = replica.calls[1][0]
    assert list(second.prompt_ids) == t.prompt_ids + turn1 + between
    assert second.session_id == replica.calls[0][0].session_id


def test_a_turns_tool_results_go_back_in_one_user_message_without_a_tool_role(tok):
    calls = (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
    )
    (t,), _ = run_loop(tok, [calls, "Answer: 42"], max_new_tokens=300)
    assert t.info["tool_calls"] == 2
    # as Qwen2.5's template renders consecutive tool messages: one user turn, a block each
    assert (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
        "<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in tok.decode(t.token_ids)


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_the_tool_loop_on_templates_with_turns_of_their_own(tok, family):
    """Gemma 2's template takes no system message, alternates user and model turns, and closes
    a turn with <end_of_turn>, not its EOS; Phi-3's closes one with <|end|> and ends a finished
    conversation with its EOS. The loop's tokens are the template's own rendering of the
    conversation, the newline after the end of a turn included."""
    styled = chat_style(tok, family)
    end_id, end = end_of_turn(styled)
    assert end == {"gemma2": "<end_of_turn>", "phi3": "<|end|>"}[family]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    (t,), replica = run_loop(styled, [call, call, "Answer: 42"])
    assert (t.turns, t.stop_reason, t.info["tool_calls"]) == (3, "stop", 2)
    result = {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    conversation = [
        {"role": "user", "content": "What is 2+40?"},
        {"role": "assistant", "content": call},
        result,
        {"role": "assistant", "content": call},
        result,
        {"role": "assistant", "content": "Answer: 42"},
    ]
    rendered = render(styled, conversation, generation=False)
    assert styled.decode(t.all_token_ids) == rendered[: rendered.rindex(end) + len(end)]
    # the last turn continued the conversation exactly, and ended at the end of its turn
    answer = [*styled.encode("Answer: 42", add_special_tokens=False), end_id]
    assert t.all_token_ids == [*replica.calls[2][0].prompt_ids, *answer]


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'


@pytest.mark.parametrize(
    ("family", "stop", "between"),
    [
        # gpt-oss's refuses a tool message without an assistant message holding its call
        (
            "gptoss",
            "<|call|>",
            '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"42"<|end|>'
            "<|start|>assistant",
        ),
        # Gemma 4's writes the result into the turn of the call, which goes on after it (and a
        # tool message without that turn as nothing at all)
        ("gemma4", "<|tool_response>", 'response:add{value:<|"|>42<|"|>}<tool_response|>'),
        # Qwen3's writes the last assistant turn with an empty thinking block, an earlier one
        # without: the results still start right after the model's <|im_end|>
        (
            "qwen3",
            "<|im_end|>",
            "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
        ),
        # Mistral's (v0.3 style) wants the call's nine-character id with its result
        (
            "mistral",
            "</s>",
            '[TOOL_RESULTS] {"content": 42, "call_id": "call00000"}[/TOOL_RESULTS]',
        ),
    ],
)
def test_tool_results_follow_the_turn_of_their_calls_as_the_template_writes_it(
    tok, family, stop, between
):
    """The loop renders a turn's results after an assistant message holding its calls, and
    appends the template's text from the token the model ended its turn with."""
    styled = shipped_style(tok, family) if family != "mistral" else chat_style(tok, "mistral")
    (t,), replica = run_loop(styled, [(CALL, stop), "Answer: 42"])
    assert (t.turns, t.stop_reason, t.info["tool_calls"]) == (2, "stop", 1)
    first = [*styled.encode(CALL, add_special_tokens=False), styled.convert_tokens_to_ids(stop)]
    second_prompt = list(replica.calls[1][0].prompt_ids)
    assert second_prompt[: len(t.prompt_ids) + len(first)] == t.prompt_ids + first
    assert styled.decode(second_prompt[len(t.prompt_ids) + len(first) :]) == between


@pytest.mark.parametrize(
    ("family", "closing"),
    [("gptoss", "<|call|>"), ("gemma4", "<|tool_response>"), ("qwen3", "<|im_end|>")],
)
def test_a_call_turn_cut_by_its_length_is_closed_as_the_template_closes_one(tok, family, closing):
    """A turn cut by its length after complete calls gets the token the template writes after
    a call turn (gpt-oss's <|call|>, Gemma 4's <|tool_response>: not their end of turn), then
    the results."""
    styled = shipped_style(tok, family)
    (t,), replica = run_loop(styled, [CALL, "Answer: 42"], eos=False)
    assert t.turns == 2 and t.info["tool_calls"] == 1
    first = styled.encode(CALL, add_special_tokens=False)
    second_prompt = list(replica.calls[1][0].prompt_ids)
    between = styled.decode(second_prompt[len(t.prompt_ids) + len(first) :])
    assert between.startswith(closing) and "42" in between


def test_named_chat_templates_run_the_loops_as_their_default_does(tok):
    """Hermes 2's and Command R's tokenizers hold named templates (``default``, ``tool_use``): a
    dict, which the loops' caches could not take (every trajectory failed, unhashable)."""
    named = copy.deepcopy(tok)
    named.chat_template = {"default": tok.chat_template, "tool_use": tok.chat_template}
    assert end_of_turn(named) == end_of_turn(tok)
    (t,), _ = run_loop(named, [CALL, "Answer: 42"])
    (plain,), _ = run_loop(tok, [CALL, "Answer: 42"])
    assert t.turns == 2 and t.all_token_ids == plain.all_token_ids


def test_a_tool_message_the_template_writes_without_its_content_fails_the_trajectory(tok):
    """Gemma 4's template writes a tool message only inside the turn of its call: appended on
    its own it would be nothing, and the model would never read the result."""
    from treadle.agents.loops import AgentClient, AgentLoopError

    gemma4 = shipped_style(tok, "gemma4")
    client = AgentClient(None, gemma4, SamplingParams(), Limits(), "s")  # type: ignore[arg-type]
    result = [{"role": "tool", "content": "42"}]
    with pytest.raises(AgentLoopError, match="renders a 'tool' message here without its content"):
        client.encode_messages(result, after=[gemma4.convert_tokens_to_ids("<turn|>")])
    calls = numbered([ToolCall("add", {"a": 2, "b": 40})])
    result = result_messages(gemma4, ["42"], calls)  # (with the call's id, which it looks up)
    ids = client.encode_messages(
        result, after=[gemma4.convert_tokens_to_ids("<|tool_response>")], calls=calls
    )
    assert gemma4.decode(ids) == 'response:add{value:<|"|>42<|"|>}<tool_response|>'


def test_a_turn_cut_by_its_length_is_closed_before_what_follows_it(tok):
    """A model turn that did not end with the template's end-of-turn token gets it before the
    appended messages: the model then reads the conversation as the template writes it."""
    from treadle.agents.loops import AgentClient

    client = AgentClient(None, tok, SamplingParams(), Limits(), "s")  # type: ignore[arg-type]
    note = [{"role": "user", "content": "Check."}]
    cut = tok.encode("Answer: 4", add_special_tokens=False)
    closed = "<|im_end|>\n<|im_start|>user\nCheck.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(client.encode_messages(note, after=cut)) == closed
    ended = [*cut, tok.convert_tokens_to_ids("<|im_end|>")]
    assert tok.decode(client.encode_messages(note, after=ended)) == closed.removeprefix(
        "<|im_end|>"
    )
    # a turn ended by another of the model's stop tokens is not closed again
    other = [*cut, tok.convert_tokens_to_ids("<|pad|>")]
    assert tok.decode(client.encode_messages(note, after=other)) == closed.removeprefix(
        "<|im_end|>\n"
    )


@pytest.mark.slow  # imports vLLM (~7 s) for its parser
def test_the_tools_loop_parses_calls_with_the_parser_rollout_tool_parser_names(tok):
    """Llama 3's template asks for a bare JSON call; vLLM's llama3_json parser reads it, as the
    endpoint's does, and the call runs."""
    with pytest.raises(ConfigError, match=r"rollout\.tool_parser=llama3_json: .*<\|python_tag\|>"):
        call_parser(tok, "llama3_json", toolbox().schemas)  # a tokenizer without its token
    llama = copy.deepcopy(tok)
    llama.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    parse = call_parser(llama, "llama3_json", toolbox().schemas)
    call = '{"name": "add", "parameters": {"a": 2, "b": 40}}'
    (t,), _ = run_loop(tok, [call, "Answer: 42"], parse_calls=parse)
    assert (t.turns, t.info["tool_calls"], t.info["tool_errors"]) == (2, 1, 0)
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(t.token_ids)
    assert parse("no call here") == []


def test_calls_from_vllm_s_parsers_keep_their_ids_and_name_bad_arguments():
    from types import SimpleNamespace

    from treadle.agents.tools import _from_openai, result_messages

    def call(arguments: str) -> dict:
        return {"id": "abc123XYZ", "function": {"name": "add", "arguments": arguments}}

    good = _from_openai(call('{"a": 2, "b": 40}'))
    assert good == ToolCall("add", {"a": 2, "b": 40}, None, "abc123XYZ")
    assert _from_openai(call("{nope")).error.startswith("the arguments of add are not valid JSON")
    assert _from_openai(call("[1]")).error == "the arguments of add must be a JSON object"
    # a template with a tool role gets the call's id and name with its result (Mistral's asks)
    with_tools = SimpleNamespace(chat_template="{% if tools %}{{ tools }}{% endif %}")
    assert result_messages(with_tools, ["42"], [good]) == [
        {"role": "tool", "content": "42", "tool_call_id": "abc123XYZ", "name": "add"}
    ]
    assert result_messages(with_tools, ["42"], [ToolCall("add", {})]) == [
        {"role": "tool", "content": "42"}  # (hermes: no id, as before)
    ]


def test_a_template_that_writes_today_s_date_goes_on_past_midnight(tok, monkeypatch):
    """Llama 3.2's template writes today's date in its system turn: the base conversation the
    loops cut appended messages from is rendered again when the date moved on (it was a
    failed trajectory from then on)."""
    import datetime

    from transformers.utils import chat_template_utils

    from treadle.agents.loops import AgentClient

    dated = copy.deepcopy(tok)
    dated.chat_template = "{{ strftime_now('%d %b %Y') }}\n" + str(tok.chat_template)
    day = [datetime.datetime(2026, 12, 1, 23, 59)]

    class Clock:
        @staticmethod
        def now(tz: object = None) -> datetime.datetime:
            return day[0]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)
    client = AgentClient(None, dated, SamplingParams(), Limits(), "s")  # type: ignore[arg-type]
    note = [{"role": "user", "content": "Check."}]
    before = client.encode_messages(note)
    day[0] += datetime.timedelta(minutes=2)
    assert client.encode_messages(note) == before
    assert dated.decode(before) == "<|im_start|>user\nCheck.<|im_end|>\n<|im_start|>assistant\n"


def test_tool_errors_go_back_to_the_model_and_turns_are_bounded(tok):
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    (t,), _ = run_loop(tok, [bad] * 3, limits=Limits(3, 800, 32))
    assert (t.turns, t.stop_reason) == (3, "max_turns")
    assert t.info["tool_calls"] == 2 and t.info["tool_errors"] == 2
    assert "Error: unknown tool 'nope'" in tok.decode(t.token_ids)


def test_the_budget_bounds_a_trajectory_and_tool_output_is_cut(tok):
    call = '<tool_call>{"name": "slow", "arguments": {"seconds": 0}}</tool_call>'
    (t,), replica = run_loop(tok, [call] * 4, limits=Limits(8, 200, 2))
    assert len(t.token_ids) <= 200 and t.stop_reason == "length"
    assert "<tool_response>\nwo ...(cut)\n</tool_response>" in tok.decode(t.token_ids)
    # every turn asked for at most what was left of the budget
    assert len(replica.calls) == t.turns
    for (request,) in replica.calls:
        used = len(request.prompt_ids) - len(t.prompt_ids)
        assert request.params.max_new_tokens == min(120, 200 - used)


def test_single_turn_sends_the_whole_batch_in_one_call(tok):
    samples = [
        Sample(f"u:{i}", tok(f"What is {i}+1?")["input_ids"], f"{i}+1", str(i + 1), {})
        for i in range(3)
    ]
    trajectories, replica = run_loop(
        tok, ["1", "2", "3", "4", "5", "6"], loop=single_turn, copies=2, samples=samples
    )
    assert len(replica.calls) == 1 and len(replica.calls[0]) == 6  # one fan-out, as before
    sessions = [r.session_id for r in replica.calls[0]]
    assert sessions[0] == sessions[1] != sessions[2] == sessions[3]  # a prompt's samples
    assert [t.turns for t in trajectories] == [1] * 6
    assert all(t.loss_mask == [1] * len(t.token_ids) for t in trajectories)


def test_a_failing_custom_loop_names_itself_and_the_sample(tok, tmp_path):
    path = tmp_path / "loop.py"
    path.write_text(
        "from treadle.agents import Trajectory\n"
        "async def broken(client, sample, tools):\n"
        "    raise ValueError('oops')\n"
        "async def empty(client, sample, tools):\n"
        "    return Trajectory(list(sample.prompt_ids))\n"
        "def not_async(client, sample, tools):\n"
        "    pass\n"
    )
    with pytest.raises(
        AgentLoopError, match=r"agent loop 'broken' failed on sample u:1: ValueError: oops"
    ):
        run_loop(tok, ["x"], loop=load_agent_loop(f"{path}:broken"))
    with pytest.raises(AgentLoopError, match="no model turn"):
        run_loop(tok, ["x"], loop=load_agent_loop(f"{path}:empty"))
    with pytest.raises(ConfigError, match="must be an async function"):
        load_agent_loop(f"{path}:not_async")
    with pytest.raises(ConfigError, match="unknown loop 'tool'"):
        load_agent_loop("tool")


def test_trajectory_check_names_inconsistent_lengths():
    t = Trajectory([1, 2])
    t.add_response(Response("r", [5, 6], [-1.0, -1.0], "stop", 0, "x"))
    t.add_tokens([7])
    t.check()
    assert t.token_versions == [0, 0, -1]  # the tool token was not sampled
    t.log_probs.append(0.0)
    with pytest.raises(ValueError, match="3 token ids, 3 loss-mask entries, 4 log-probs and 3 "):
        t.check()


def test_outcome_reward_lands_on_the_last_model_token_of_a_gapped_mask():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    rewards = outcome_rewards(mask, [1.0, 0.5, 2.0])
    assert rewards.tolist() == [
        [0, 0, 0, 0, 0, 1.0, 0],
        [0.5, 0, 0, 0, 0, 0, 0],
        [2.0, 0, 0, 0, 0, 0, 0],
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.tools=[m:f]"], "rollout.tools are called by an agent loop"),
        (["rollout.agent_loop=tools"], "rollout.agent_loop=tools needs rollout.tools"),
        (
            ["rollout.max_turns=3", "rollout.max_response_length=64"],
            r"^rollout\.max_turns=3, rollout\.max_response_length=64 are read by agent loops of "
            r"several turns \(rollout\.agent_loop=tools, env or one of your own\), not by "
            r"single_turn: set rollout\.agent_loop, or remove them$",
        ),
        (
            ["rollout.agent_loop=tools", "rollout.tools=[m:f]", "data.apply_chat_template=false"],
            "set data.apply_chat_template=true",
        ),
    ],
)
def test_agent_config_mistakes_are_named(overrides, message):
    from treadle.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_response_length_of_agent_loops():
    from treadle.config import load_config

    one = load_config(None, ["rollout.max_new_tokens=16"])
    assert one.response_length() == 16
    tools = ["rollout.agent_loop=tools", "rollout.tools=[m:f]", "rollout.max_new_tokens=16"]
    cfg = load_config(None, [*tools, "rollout.max_turns=3", "rollout.max_tool_response_tokens=8"])
    assert cfg.response_length() == 3 * (16 + 8)
    assert load_config(None, [*tools, "rollout.max_response_length=50"]).response_length() == 50


def test_a_turn_cut_by_length_still_runs_the_calls_it_closed(tok):
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call> and so'
    (t,), _ = run_loop(tok, [call, "Answer: 42 and", "never asked"], eos=False)
    assert (t.turns, t.stop_reason, t.info["tool_calls"]) == (2, "length", 1)
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(t.token_ids)
    (t,), _ = run_loop(tok, ['<tool_call>{"name": "add", "argum'], eos=False)
    assert (t.turns, t.stop_reason, t.info["tool_calls"]) == (1, "length", 0)
