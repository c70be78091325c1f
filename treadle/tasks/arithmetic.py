"""The built-in task: integer addition and subtraction, small enough to learn on a laptop CPU.

Everything treadle needs for a run without a model hub is built here from nothing:

- problems (`generate_problems`), deterministic from a seed, written as held-out JSONL splits
  (`write_splits`: no test prompt appears in train);
- a worked answer per problem for SFT, short and mechanical (one column of digits per step,
  right to left, with the carry or borrow written out) so a ~1M-parameter model can learn it:

      47+38: 7+8=15 carry 1, 4+3+1=8. Answer: 85
      83-47: 13-7=6 borrow 1, 8-1-4=3. Answer: 36

  Subtraction problems are drawn with the larger operand first, so results are never negative;
- preference pairs for DPO and reward models (`write_pairs`): the worked answer as chosen, a
  plausible wrong one (`wrong_solution`: a carry or borrow not applied, or a column off by
  one, carried through to the answer) as rejected;
- the verifier (`extract_answer`, `compute_score`) used as the RL reward: it reads the last
  `Answer: <int>`, or failing that the last integer, so a bare `Answer: 85` also scores;
- a byte-level BPE tokenizer trained on the data (`build_tokenizer`), every digit its own token,
  ChatML special tokens and chat template;
- a randomly initialised Qwen2- or Llama-shaped model saved as an ordinary HF model folder
  (`build_tiny_model`);
- `prepare`, which does all of the above into one directory and reuses it when its manifest
  (the arguments) matches.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# torch, tokenizers and transformers are imported where a model or tokenizer is built, so that
# the reward function (`compute_score`) loads in a reward worker without them

logger = logging.getLogger(__name__)

OPS = "+-"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML as Qwen2 writes it, without a default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2): `\p{N}` alone
# makes every digit a separate pre-token.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ARCHS = ("qwen2", "llama")  # the task's own; the tests build other families too
# Bump when the files prepare() writes change meaning, so old directories are rebuilt.
PREPARE_FORMAT = 2  # 2: preference pairs

_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)", re.IGNORECASE)
# An integer, with its minus sign only when the minus is not an operator between two numbers.
_INT_RE = re.compile(r"(?<!\d)-?\d+")


# --- problems --------------------------------------------------------------------------------


def worked_solution(a: int, op: str, b: int) -> str:
    """The SFT target for `a op b`: one step per digit column, then `Answer: <result>`."""
    steps, result = _column_steps(a, op, b)
    if result != (a + b if op == "+" else a - b):  # the column arithmetic is the task's ground
        raise AssertionError(f"column steps of {a}{op}{b} give {result}")
    return f"{a}{op}{b}: {', '.join(steps)}. Answer: {result}"


def wrong_solution(a: int, op: str, b: int, rng: random.Random) -> str:
    """A plausible wrong worked answer for `a op b` (a DPO / reward-model "rejected" response).

    One slip, carried through to the answer: a carry or borrow announced but not applied to
    the next column (when there is one, half of the time), or one column's result off by one:

        47+38: 7+8=15 carry 1, 4+3=7. Answer: 75
        47+38: 7+8=16 carry 1, 4+3+1=8. Answer: 86
    """
    correct = a + b if op == "+" else a - b
    steps, _ = _column_steps(a, op, b)
    dropped = [k for k, step in enumerate(steps[:-1]) if step.endswith(("carry 1", "borrow 1"))]
    while True:
        if dropped and rng.random() < 0.5:
            steps, result = _column_steps(a, op, b, drop=rng.choice(dropped))
        else:
            slip = (rng.randrange(len(steps)), rng.choice((-1, 1)))
            steps, result = _column_steps(a, op, b, slip=slip)
        if result != correct:
            return f"{a}{op}{b}: {', '.join(steps)}. Answer: {result}"


def _column_steps(
    a: int, op: str, b: int, *, drop: int | None = None, slip: tuple[int, int] | None = None
) -> tuple[list[str], int]:
    """The written steps of `a op b`, right to left, and the result they arrive at.

    `drop`: the column whose carry/borrow is not applied to the next one; `slip`:
    `(column, delta)`, that column's result written off by `delta`. Both are mistakes, for
    rejected responses; without them the steps are the worked solution.
    """
    columns = [(int(x), int(y)) for x, y in zip_longest(str(a)[::-1], str(b)[::-1], fillvalue="0")]
    if op not in OPS:
        raise ValueError(f"unsupported operator {op!r}: use one of {OPS!r}")
    column = _addition_column if op == "+" else _subtraction_column
    steps, digits, carry = [], [], 0
    for k, (x, y) in enumerate(columns):
        delta = slip[1] if slip is not None and slip[0] == k else 0
        step, digit, carry = column(x, y, carry, delta)
        steps.append(step)
        digits.append(digit)
        if k == drop:
            carry = 0
    result = sum(d * 10**k for k, d in enumerate(digits)) + carry * 10 ** len(digits)
    return steps, result


def _addition_column(x: int, y: int, carry: int, delta: int) -> tuple[str, int, int]:
    """`x+y(+1)=total`, then `carry 1` when total >= 10; returns (step, digit, carry out)."""
    total = max(x + y + carry + delta, 0)
    step = f"{x}+{y}{'+1' if carry else ''}={total}"
    return step + (" carry 1" if total >= 10 else ""), total % 10, total // 10


def _subtraction_column(x: int, y: int, borrow: int, delta: int) -> tuple[str, int, int]:
    """`x(-1)-y=digit`, or `1x(-1)-y=digit borrow 1`; returns (step, digit, borrow out)."""
    top = f"{x}{'-1' if borrow else ''}"
    digit = x - borrow - y
    if digit < 0:
        digit = (digit + 10 + delta) % 10
        return f"1{top}-{y}={digit} borrow 1", digit, 1
    digit = (digit + delta) % 10
    return f"{top}-{y}={digit}", digit, 0


def _count_distinct(min_value: int, max_value: int, ops: str) -> int:
    size = max_value - min_value + 1
    return sum(size * size if op == "+" else size * (size + 1) // 2 for op in set(ops))


def generate_problems(
    n: int, seed: int, *, min_value: int = 0, max_value: int = 99, ops: str = OPS
) -> list[dict[str, str]]:
    """`n` distinct problems, the same for the same arguments.

    Each row is `{"prompt": "What is 47+38?", "answer": "85", "solution": <worked answer>}`.
    Operands are uniform in `[min_value, max_value]`; a subtraction puts the larger first.
    """
    if not ops or set(ops) - set(OPS):
        raise ValueError(f"ops must be a non-empty string of {OPS!r}, got {ops!r}")
    if not 0 <= min_value <= max_value:
        raise ValueError(f"need 0 <= min_value <= max_value, got {min_value}, {max_value}")
    available = _count_distinct(min_value, max_value, ops)
    if n > available:
        raise ValueError(
            f"asked for {n} distinct problems but operands in [{min_value}, {max_value}] "
            f"with ops {ops!r} give only {available}: widen the range or ask for fewer"
        )
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < n:
        op = rng.choice(ops)
        a, b = rng.randint(min_value, max_value), rng.randint(min_value, max_value)
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"What is {a}{op}{b}?"
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = a + b if op == "+" else a - b
        rows.append(
            {"prompt": prompt, "answer": str(answer), "solution": worked_solution(a, op, b)}
        )
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_splits(
    out_dir: str | Path, *, n_train: int, n_test: int, seed: int, **gen_kwargs: Any
) -> dict[str, Path]:
    """Write `train.jsonl` and `test.jsonl` under `out_dir`; return `{"train": ..., "test": ...}`.

    Both splits come from one stream of distinct problems (test first, so the test set does not
    change with `n_train`), so no test prompt can appear in train; this is checked anyway.
    """
    rows = generate_problems(n_test + n_train, seed, **gen_kwargs)
    test, train = rows[:n_test], rows[n_test:]
    leaked = {r["prompt"] for r in test} & {r["prompt"] for r in train}
    if leaked:  # cannot happen with distinct problems; guards future changes to the generator
        raise AssertionError(f"{len(leaked)} test prompts also in train, e.g. {min(leaked)!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl"}
    write_jsonl(train, paths["train"])
    write_jsonl(test, paths["test"])
    return paths


def write_pairs(out_dir: str | Path, *, seed: int) -> dict[str, Path]:
    """Preference pairs of both splits: `pairs_train.jsonl`, `pairs_test.jsonl` under `out_dir`.

    One pair per problem of `train.jsonl` / `test.jsonl` (which must exist): `prompt`,
    `answer`, `chosen` (the worked solution) and `rejected` (`wrong_solution`, seeded).
    """
    out = Path(out_dir)
    paths = {}
    for split in ("train", "test"):
        rng = random.Random(f"pairs:{seed}:{split}")
        rows = []
        with (out / f"{split}.jsonl").open(encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                a, op, b = _parse_prompt(row["prompt"])
                rejected = wrong_solution(a, op, b, rng)
                rows.append(
                    {
                        "prompt": row["prompt"],
                        "answer": row["answer"],
                        "chosen": row["solution"],
                        "rejected": rejected,
                    }
                )
        paths[f"pairs_{split}"] = out / f"pairs_{split}.jsonl"
        write_jsonl(rows, paths[f"pairs_{split}"])
    return paths


_PROMPT_RE = re.compile(r"^What is (\d+)([+-])(\d+)\?$")


def _parse_prompt(prompt: str) -> tuple[int, str, int]:
    match = _PROMPT_RE.match(prompt)
    if match is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    return int(match.group(1)), match.group(2), int(match.group(3))


# --- verifier --------------------------------------------------------------------------------


def extract_answer(text: str) -> str | None:
    """The integer after the last `Answer:`, else the last integer in `text`, else None.

    Returned normalised (`"085"` -> `"85"`, `"-0"` -> `"0"`).
    """
    matches = _ANSWER_RE.findall(text) or _INT_RE.findall(text)
    if not matches:
        return None
    # Normalised as a string: int() refuses more than 4300 digits, which a policy can emit.
    number = matches[-1]
    digits = number.lstrip("-").lstrip("0") or "0"
    return "-" + digits if number.startswith("-") and digits != "0" else digits


def expected_integer(ground_truth: str) -> str:
    """The integer ``ground_truth`` holds, as the rewards compare it (``' 007'`` -> ``'7'``).

    A ground truth that is not an integer raises ValueError: it is a data bug, not a wrong answer.
    """
    return str(int(str(ground_truth).strip()))


def ground_truth_problem(ground_truth: str) -> str | None:
    """What the integer rewards (this one's, chat_arithmetic's, calculator's) refuse in
    ``ground_truth`` (None: nothing): ``treadle check`` asks it of every row up front, so a bad
    row is not found at whichever step draws it."""
    try:
        expected_integer(ground_truth)
    except ValueError:
        return "is not an integer"
    return None


def compute_score(prompt: str, response: str, ground_truth: str) -> float:
    """1.0 if the response's extracted integer equals `ground_truth`, else 0.0.

    A ground truth that is not an integer raises ValueError (:func:`expected_integer`).
    """
    del prompt  # the answer alone decides
    return 1.0 if extract_answer(response) == expected_integer(ground_truth) else 0.0


def answer_of(response: str, row: Mapping[str, Any]) -> str | None:
    """The answer ``compute_score`` reads in ``response`` (what maj@k votes on)."""
    del row
    return extract_answer(response)


# --- tokenizer and model ---------------------------------------------------------------------


def build_tokenizer(
    corpus_texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 320
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `corpus_texts` and save it to `out_dir`.

    The pipeline is Qwen2's (NFC, its split regex, byte-level BPE): transformers 5 rebuilds the
    pipeline of any `qwen2` model folder that way when loading, so training with it keeps the
    saved and the loaded tokenizer identical. The regex isolates every digit, so each digit is
    its own token; the 256 byte symbols are always in the vocabulary, so any NFC text (all
    task text) round-trips.
    Special tokens: `<|pad|>` (padding), `<|im_start|>`, `<|im_end|>` (end of turn, the EOS).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from treadle.models.loading import save_tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The role names of the chat template are words of the corpus too.
    roles = ["system\n", "user\n", "assistant\n"] * 2
    tok.train_from_iterator([*corpus_texts, *roles], trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        unk_token=None,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
    )
    save_tokenizer(hf_tok, out_dir)
    return hf_tok


@dataclass(frozen=True)
class ModelShape:
    """The shape of `build_tiny_model`'s model, one place for its defaults: `prepare` takes it
    whole and records it in its manifest, field by field."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_positions: int = 256
    arch: str = "qwen2"

    def halved(self) -> ModelShape:
        """Half the width and depth with the head size kept (vLLM's CPU attention needs it)."""
        heads = max(self.num_heads // 2, 1)
        return replace(
            self,
            hidden_size=self.hidden_size * heads // self.num_heads,
            num_layers=max(self.num_layers // 2, 1),
            num_heads=heads,
            num_kv_heads=max(self.num_kv_heads // 2, 1),
            intermediate_size=self.intermediate_size // 2,
        )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    out_dir: str | Path,
    shape: ModelShape = ModelShape(),
    *,
    seed: int = 0,
    **more: Any,
) -> Path:
    """Randomly initialise a small causal LM of `shape` for `tokenizer` and save it with the
    tokenizer. ``shape.arch``: any model type transformers knows (the tests build OLMo 2 and
    mixtures of experts too); ``more``: more config keys (the experts' counts).

    The folder (safetensors weights, config, generation config, tokenizer) loads with
    `AutoModelForCausalLM.from_pretrained` like any hub model. Input and output embeddings are
    tied. The global torch RNG is left as it was.
    """
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    from treadle.models.loading import count_parameters, save_tokenizer

    if shape.arch not in CONFIG_MAPPING:
        raise ValueError(
            f"arch must be a model type transformers knows, such as {ARCHS}: got {shape.arch!r}"
        )
    config = AutoConfig.for_model(
        shape.arch,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **more,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tokenizer, out)
    logger.info("built %s model with %d parameters in %s", shape.arch, count_parameters(model), out)
    return out


# --- everything at once ----------------------------------------------------------------------


def prepare(
    out_dir: str | Path,
    *,
    seed: int = 0,
    n_train: int = 5000,
    n_test: int = 500,
    min_value: int = 0,
    max_value: int = 99,
    ops: str = OPS,
    vocab_size: int = 320,
    shape: ModelShape = ModelShape(),
) -> dict[str, Path]:
    """Build data splits, a tokenizer trained on the train split and initial models: the
    paths of train, test, pairs_train, pairs_test (`write_pairs`), model (`out_dir/model_init`,
    of `shape`), model_small (smaller, same tokenizer) and manifest. When `out_dir/prepare.json`
    records the same arguments and all the files exist, nothing is rebuilt; the manifest is
    written last, so an interrupted run is rebuilt next time."""
    gen = {"min_value": min_value, "max_value": max_value, "ops": ops}
    manifest = {
        "task": "arithmetic",
        "format": PREPARE_FORMAT,
        "seed": seed,
        "n_train": n_train,
        "n_test": n_test,
        "vocab_size": vocab_size,
        **gen,
        **asdict(shape),
    }
    out = Path(out_dir)
    paths = _task_paths(out)
    if _is_prepared(paths, manifest):
        logger.info("reusing prepared arithmetic task in %s", out)
    else:
        paths["manifest"].unlink(missing_ok=True)
        write_splits(out, n_train=n_train, n_test=n_test, seed=seed, **gen)
        write_pairs(out, seed=seed)
        shutil.rmtree(paths["model"], ignore_errors=True)
        tokenizer = build_tokenizer(_corpus(paths["train"]), paths["model"], vocab_size=vocab_size)
        build_tiny_model(tokenizer, paths["model"], shape, seed=seed)
        shutil.rmtree(paths["model_small"], ignore_errors=True)
        write_manifest(paths["manifest"], manifest)
    _small_student(paths, shape, seed)  # (also for a task prepared before it existed)
    return paths


def _small_student(paths: dict[str, Path], shape: ModelShape, seed: int) -> None:
    """``model_small``: the initial model at half the width and depth (head size kept, so
    vLLM's CPU attention runs it), with the same tokenizer: a smaller student to distil into
    (``examples/distill``). Built when missing, also in a task prepared before it existed."""
    if (paths["model_small"] / "model.safetensors").is_file():
        return
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(paths["model"])
    tmp = paths["model_small"].with_name("model_small.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tokenizer, tmp, shape.halved(), seed=seed)
    tmp.replace(paths["model_small"])


def _task_paths(out: Path) -> dict[str, Path]:
    paths = {name: out / f"{name}.jsonl" for name in ("train", "test", "pairs_train", "pairs_test")}
    return {
        **paths,
        "model": out / "model_init",
        "model_small": out / "model_small",
        "manifest": out / "prepare.json",
    }


def _corpus(train: Path) -> list[str]:
    """The texts a tokenizer learns from: every prompt and worked solution of ``train``."""
    with train.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [text for row in rows for text in (row["prompt"], row["solution"])]


def manifest_matches(path: Path, manifest: dict[str, Any], files: Iterable[Path]) -> bool:
    """True when `path` records exactly `manifest` and every one of `files` exists."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return bool(recorded == manifest and all(f.is_file() for f in files))


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest last and atomically: a directory without it is rebuilt."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def write_held_out(
    out_dir: str | Path,
    manifest: dict[str, Any],
    rows: Callable[[], list[dict[str, str]]],
    n_test: int,
) -> dict[str, Path]:
    """Write `test.jsonl` (the first `n_test` of `rows()`) and `train.jsonl` (the rest) under
    `out_dir`, unless its `prepare.json` already records `manifest`; the manifest goes last.

    `rows()` yields distinct problems, test first, so the test set does not depend on how many
    train rows there are and no test prompt is in train."""
    out = Path(out_dir)
    paths = {"train": out / "train.jsonl", "test": out / "test.jsonl"}
    manifest_path = out / "prepare.json"
    if manifest_matches(manifest_path, manifest, paths.values()):
        logger.info("reusing prepared %s task in %s", manifest.get("task", ""), out)
        return paths
    every = rows()
    test, train = every[:n_test], every[n_test:]
    leaked = {r["prompt"] for r in test} & {r["prompt"] for r in train}
    if leaked:  # cannot happen with distinct problems; guards future changes to a generator
        raise AssertionError(f"{len(leaked)} test prompts also in train, e.g. {min(leaked)!r}")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)
    write_jsonl(train, paths["train"])
    write_jsonl(test, paths["test"])
    write_manifest(manifest_path, manifest)
    return paths


def _is_prepared(paths: dict[str, Path], manifest: dict[str, Any]) -> bool:
    model_files = ("config.json", "model.safetensors", "tokenizer.json")
    data = [paths[k] for k in ("train", "test", "pairs_train", "pairs_test")]
    files = [*data, *(paths["model"] / name for name in model_files)]
    return manifest_matches(paths["manifest"], manifest, files)
