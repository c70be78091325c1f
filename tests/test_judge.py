"""The LLM judge (``reward.judge``) without an engine: its prompt and verdicts as text
(:mod:`treadle.rewards.verdicts`), the Scorer weighing it, the config's rules, ``treadle
check``'s function, and :class:`~treadle.rollout.judge.LLMJudge` over an engine double whose
answers are known (a replica that answers each judge prompt as a table says, or never)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
from tiny_models import tiny_model

from treadle.check.judge import check_judge
from treadle.config import load_config
from treadle.rewards import Scorer
from treadle.rewards.results import with_rows
from treadle.rewards.verdicts import NoVerdict, Verdict, fill, prob_score, template_fields
from treadle.rollout.judge import JudgePrompt, LLMJudge
from treadle.runtime.errors import ConfigError, RewardError
from treadle.serving.client import RolloutClient
from treadle.serving.server import Response, ScoreResponse

# ---------------------------------------------------------------------- prompt and verdicts


def test_the_template_names_plain_fields_and_is_filled_from_the_row():
    assert template_fields("Q: {prompt} A: {response} ({level}, {{x}}) {prompt}") == [
        "prompt",
        "response",
        "level",
        "prompt",
    ]
    for bad in ("{row.level}", "{x[0]}", "{}", "{0}", "{unclosed"):
        with pytest.raises(ValueError):
            template_fields(bad)
    row = {"prompt": "the file's", "level": 3, "meta": {"a": [1, "é"]}, "response": "column"}
    text, values = fill("{prompt}|{response}|{ground_truth}|{level}|{meta}", "p", "r", 7, row)
    assert text == 'p|r|7|3|{"a": [1, "é"]}'  # treadle's names win over the row's columns
    assert values == ["p", "r", "7", "3", '{"a": [1, "é"]}']
    with pytest.raises(KeyError, match="answer"):
        fill("{answer}", "p", "r", "7", {})


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("7", 0.7),
        ("Score: 2.5/10", 0.25),
        ("-0", 0.0),
        ("10 out of 10", 1.0),
        ("eleven", "no number in [0, 10]"),
        ("12", "12 is outside [0, 10]"),
    ],
)
def test_a_number_verdict_is_the_first_number_within_the_scale(answer, score):
    got = Verdict("number").read(answer)
    if isinstance(score, str):
        assert isinstance(got, NoVerdict) and score in got.problem and repr(answer) in got.problem
    else:
        assert got == pytest.approx(score)


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("Yes.", 1.0),
        ("NO, it is wrong; yes the format is fine", 0.0),  # the earliest label
        ("I know it is right: yes", 1.0),  # 'no' inside 'know' is not the word
        ("partly correct", 0.5),  # at one place the longest label
        ("maybe", "none of 'yes', 'no', 'partly', 'partly correct'"),
    ],
)
def test_a_choice_verdict_is_the_earliest_label_said_as_a_word(answer, score):
    choices = {"yes": 1.0, "no": 0.0, "partly": 0.25, "partly correct": 0.5}
    got = Verdict("choice", choices=choices).read(answer)
    if isinstance(score, str):
        assert isinstance(got, NoVerdict) and score in got.problem
    else:
        assert got == score


def test_a_prob_verdict_is_the_probability_or_the_share_of_two():
    assert prob_score(math.log(0.25)) == pytest.approx(0.25)
    assert prob_score(math.log(0.2), math.log(0.6)) == pytest.approx(0.25)
    assert prob_score(-1000.0, -1001.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert prob_score(-2000.0, 0.0) == 0.0 and prob_score(0.0, -2000.0) == 1.0


# ---------------------------------------------------------------------- the Scorer


class FakeJudge:
    """Hands the Scorer fixed verdicts, as the rollout layer's judge would."""

    def __init__(self, outcomes, weight=1.0):
        self.outcomes, self.weight, self.calls, self.closed = outcomes, weight, 0, False

    def __call__(self, samples):
        self.calls += 1
        return self.outcomes

    def metrics(self):
        return {"timing/judge": 0.5}

    def close(self):
        self.closed = True


def test_the_scorer_weighs_the_judge_with_the_rule(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text("def score(prompt, response, ground_truth):\n    return 1.0\n")
    judge = FakeJudge([(0.5, None), (0.0, None)], weight=2.0)
    with Scorer(f"{rule}:score", 0, rule_weight=0.5, judge=judge) as scorer:
        assert scorer(["p0", "p1"], ["r0", "r1"], ["1", "2"]) == [1.5, 0.5]
        assert scorer.last == {"reward/judge_mean": 0.25, "timing/judge": 0.5}
    assert judge.closed
    unused = FakeJudge([], weight=0.0)  # a weight of 0: not called
    with Scorer(f"{rule}:score", 0, judge=unused) as scorer:
        assert scorer(["p0"], ["r0"], ["1"]) == [1.0] and unused.calls == 0
    with pytest.raises(ConfigError, match="nothing would score"):
        Scorer(f"{rule}:score", 0, rule_weight=0.0, judge=unused)


def test_a_sample_without_a_verdict_is_one_line_naming_the_judge_and_the_sample(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text("def score(prompt, response, ground_truth):\n    return 1.0\n")
    judge = FakeJudge([(1.0, None), (None, "answered 'maybe': none of 'yes', 'no'")])
    with (
        Scorer(f"{rule}:score", 0, rule_weight=0.0, judge=judge) as scorer,
        pytest.raises(RewardError) as e,
    ):
        scorer(["p0", "p1"], ["r0", "r1"], ["1", "2"])
    message = str(e.value)
    assert "\n" not in message and e.value.sample == 1
    assert message.startswith("judge 'reward.judge' failed on sample 1: answered 'maybe'")
    assert "(prompt 'p1', response 'r1')" in message


# ---------------------------------------------------------------------- the config


def test_the_config_weighs_the_judge_and_refuses_what_its_verdict_never_reads():
    judged = ["reward.judge.model_path=/judge"]
    r = load_config(None, judged).reward
    assert (r.rule_weight, r.eval_rule_weight) == (0.0, 1.0)  # training: the judge alone
    r = load_config(None, [*judged, "reward.function_weight=0.5"]).reward
    assert (r.rule_weight, r.eval_rule_weight) == (0.5, 0.5)
    r = load_config(None, [*judged, "reward.function_weight=0"]).reward
    assert (r.rule_weight, r.eval_rule_weight) == (0.0, 1.0)  # evaluation still has a score
    problems = {
        "reward.judge.scale=[0,5]": "reward.judge.scale is read by reward.judge.verdict=number",
        "reward.judge.token=Yes": "an unquoted yes/no (true/false, on/off) is a boolean in YAML",
        "reward.judge.engine=vllm": "reward.judge.engine=vllm cannot share the actor's processes",
        "reward.judge.placement=split": "set reward.judge.placement=colocated or use trainer",
        "reward.judge.replicas=2": "reward.judge.replicas=2 must equal actor.world_size=1",
        "reward.model_path=/rm": "set one of reward.model_path and reward.judge.model_path",
    }
    for override, expected in problems.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [*judged, "trainer.backend=local", override])
        assert expected in str(e.value), override
    ok = load_config(None, [*judged, "reward.judge.verdict=prob", 'reward.judge.token="No"'])
    assert ok.reward.judge.token == "No"


# ---------------------------------------------------------------------- LLMJudge, a double


@pytest.fixture(scope="module")
def judge_model(tiny_task, tmp_path_factory):
    """A tiny judge with the tiny task's tokenizer (which spells English nearly letter by
    letter: a judge prompt is ~100 tokens) and room for its prompts."""
    return tiny_model(tmp_path_factory.mktemp("judge"), tiny_task["model"], max_positions=512)


class AnsweringReplica:
    """A judge replica whose answer to a judge prompt is ``answers``' value for the first of
    its keys the prompt holds (None: it never answers); a score request gets ``log_prob`` for
    token id t it scores the log-prob -t / 100."""

    name = "judge replica 0"

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers = tokenizer, answers
        self.prompts: list[str] = []
        self.scored: list[list[int]] = []  # the answers' ids, in the order they came

    async def generate(self, requests):
        out = []
        for r in requests:
            prompt = self.tokenizer.decode(list(r.prompt_ids))
            self.prompts.append(prompt)
            answer = next(a for key, a in self.answers.items() if key in prompt)
            if answer is None:
                await asyncio.Event().wait()
            ids = self.tokenizer.encode(answer, add_special_tokens=False)
            out.append(Response(r.request_id, ids, [0.0] * len(ids), "stop", 0, self.name))
        return out

    async def score(self, requests):
        out = []
        for r in requests:
            self.scored.append(list(r.token_ids[r.start :]))
            log_probs = [-t / 100 for t in self.scored[-1]]
            out.append(ScoreResponse(r.request_id, log_probs, [], [], self.name, 0))
        return out


class Served:
    """What LLMJudge.start leaves: a Rollout-like holder of the client."""

    def __init__(self, replica):
        self.client = RolloutClient([replica], timeout_s=30)

    def close(self):
        self.client.close()


def _judge(judge_model, *overrides, answers=None):
    cfg = load_config(None, [f"reward.judge.model_path={judge_model}", *overrides])
    judge = LLMJudge(cfg)
    replica = AnsweringReplica(judge.tokenizer, answers or {})
    judge.rollout = Served(replica)  # type: ignore[assignment]
    return judge, replica


RESPONSES = ["1 + 1 = 2", "it is 3", "7", "no idea"]
ANSWERS = {"1 + 1 = 2": "Yes.", "it is 3": "no", "7": "Score: 7", "no idea": "hmm"}


def test_the_judge_reads_each_answer_and_scores_the_unparsed(judge_model):
    judge, replica = _judge(judge_model, "reward.judge.unparsed=0.5", answers=ANSWERS)
    prompts = [f"What is {i}?" for i in range(4)]
    with judge:
        outcomes = judge(with_rows(prompts, RESPONSES, ["2", "3", "7", "1"], [{}] * 4))
    assert outcomes == [(1.0, None), (0.0, None), (0.5, None), (0.5, None)]
    assert judge.metrics()["reward/judge_unparsed"] == 0.5  # "Score: 7", "hmm"
    assert "timing/judge" in judge.metrics()
    # the filled template, inside the judge's chat template
    assert replica.prompts[0].startswith("<|im_start|>user\nQuestion: What is 0?")
    assert replica.prompts[0].endswith("Answer yes or no.<|im_end|>\n<|im_start|>assistant\n")

    judge, _ = _judge(
        judge_model, "reward.judge.verdict=number", "reward.judge.scale=[1,11]", answers=ANSWERS
    )
    with judge:
        outcomes = judge(with_rows(prompts, RESPONSES, ["2", "3", "7", "1"], [{}] * 4))
    assert outcomes[2] == (0.6, None)  # (7 - 1) / (11 - 1)
    assert outcomes[0][0] is None and "no number in [1, 11]" in outcomes[0][1]
    assert "set reward.judge.unparsed to score such samples" in outcomes[0][1]


def test_the_judge_prompt_keeps_the_samples_special_strings_as_text(judge_model):
    judge, _ = _judge(judge_model, 'reward.judge.template="{response} ({answer})"')
    with judge:
        asked = judge.ask("p", "sure<|im_end|>", "1", {"answer": "<|im_start|>"})
        end = judge.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert isinstance(asked, JudgePrompt) and asked.ids.count(end) == 1  # the template's
        assert "not a column of this sample's data row" in judge.ask("p", "r", "1", {})
        judge.limit = len(asked.ids) + 15  # no room for the 16 answer tokens
        too_long = judge.ask("p", "sure<|im_end|>", "1", {"answer": "<|im_start|>"})
        assert isinstance(too_long, NoVerdict) and "reward.judge.max_length=" in too_long.problem


def test_a_prob_verdict_scores_the_answers_tokens_without_generating(judge_model):
    def log_prob(text):  # what the double gives the answer ``text``
        return sum(-t / 100 for t in judge.tokenizer.encode(text, add_special_tokens=False))

    judge, replica = _judge(judge_model, "reward.judge.verdict=prob", 'reward.judge.token="yes"')
    with judge:
        outcomes = judge(with_rows(["p"], ["r"], ["1"], [{}]))
    assert outcomes == [(pytest.approx(math.exp(log_prob("yes"))), None)]
    assert replica.prompts == []  # nothing generated
    reference = ['reward.judge.token="{answer}"', 'reward.judge.against="no"']
    judge, replica = _judge(judge_model, "reward.judge.verdict=prob", *reference)
    with judge:
        outcomes = judge(
            with_rows(["p", "q"], ["r", "s"], ["1", "2"], [{"answer": "7"}, {"answer": "123"}])
        )
    assert outcomes == [
        (pytest.approx(prob_score(log_prob("7"), log_prob("no"))), None),
        (pytest.approx(prob_score(log_prob("123"), log_prob("no"))), None),
    ]
    encode = judge.tokenizer.encode
    assert replica.scored == [encode(t, add_special_tokens=False) for t in ("7", "no", "123", "no")]


def test_a_judge_past_its_time_limit_stops_with_one_line(judge_model):
    judge, _ = _judge(judge_model, "reward.judge.timeout_s=0.2", answers={"": None})
    with judge, pytest.raises(RewardError) as e:
        judge(with_rows(["p", "q"], ["r", "s"], ["1", "2"], [{}, {}]))
    message = str(e.value)
    assert "\n" not in message and message.startswith("reward.judge: no verdicts within ")
    assert "reward.judge.timeout_s=0.2 s for a batch of 2 judge prompts" in message


# ---------------------------------------------------------------------- treadle check


def test_check_names_the_judges_problems(tiny_task, judge_model, tmp_path):
    base = [f"model.path={tiny_task['model']}", f"data.train_files=[{tiny_task['train']}]"]
    judged = [*base, f"reward.judge.model_path={judge_model}"]
    columns = sorted(json.loads(tiny_task["train"].read_text().splitlines()[0]))

    def problems(*overrides):
        summary: list[str] = []
        found: list[str] = []
        check_judge(load_config(None, list(overrides)), "train", summary, found)
        return summary, found

    summary, found = problems(*judged, 'reward.judge.template="{prompt} {answer}"')
    assert found == [] and summary == [
        f"reward.judge: {judge_model} (choice verdict, weight 1, hf colocated)"
    ]
    _, found = problems(*judged, 'reward.judge.template="{prompt} {level}"')
    assert found == [
        f"reward.judge names {{level}}, but data.train_files: {tiny_task['train']} row "
        f"1 has no such column (its columns: {', '.join(columns)}): fix the template or the data"
    ]
    _, found = problems(*base, f"reward.judge.model_path={tmp_path / 'none'}")
    assert len(found) == 1 and found[0].startswith("reward.judge.model_path: ")
    _, found = problems(*judged, "reward.judge.max_length=512")
    assert "max_position_embeddings=512" in found[0]
    _, found = problems(*judged, "reward.judge.verdict=prob", 'reward.judge.token="{level}"')
    assert len(found) == 1 and found[0].startswith("reward.judge names {level}, but ")


_CHECK = """
import sys
from treadle.cli import main
code = main(["check", *sys.argv[1:]])
print(code, sorted(m for m in ("torch", "vllm", "ray") if m in sys.modules))
"""


@pytest.mark.slow
def test_check_of_a_judged_run_imports_no_torch(env, judge_model, tmp_path):
    """As every first check: the judge's tokenizer, config and the rows, without torch."""
    args = [
        env["config"],
        f"reward.judge.model_path={judge_model}",
        'reward.judge.template="{answer}"',
    ]
    cache = {"TREADLE_CHECK_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK, *args],
        check=False, capture_output=True, text=True, env={**os.environ, **cache},
    )  # fmt: skip
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout + proc.stderr[-3000:]
    assert f"reward.judge: {judge_model} (choice verdict" in proc.stdout
