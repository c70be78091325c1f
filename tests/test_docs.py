"""The README and the guides cannot drift from the code: what they show is checked against it.

Reads README.md, docs/*.md and the examples' pages; runs nothing (the site's own build, links
and anchors included, is `make docs`, which `make test` runs first):

- every command in a shell code block: ``make X`` is a Makefile target; a ``treadle`` command
  (``.venv/bin/treadle``, ``python -m treadle``, after ``--`` in ``ray job submit``) parses with
  treadle's own parser, the config it names exists (or is a YAML block shown on the same page,
  ``# name.yaml`` on its first line) and its overrides are keys of the config; ``python
  FILE.py --flag`` names a file that defines each flag; ``python -m MODULE`` a module that
  exists; ``bash FILE`` a file that exists;
- every command in running text (```treadle check CONFIG --kind train```): its subcommand
  exists and its flags are that subcommand's;
- every ``treadle.x.y`` name: the module exists and defines the name;
- every path under ``treadle/``, ``tests/``, ``bench/``, ``examples/`` and ``docs/``: it exists;
- every config key (```actor.lora.rank```): the config has it;
- the README: at most 250 lines, its first screen shows exactly ``make demo`` and ``make
  test``, and its relative links resolve.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import itertools
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from treadle.cli import build_parser
from treadle.config import Config, load_config
from treadle.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("examples/*/*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FIRST_SCREEN = 40
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)


@dataclass
class Page:
    path: Path
    text: str
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (language, body)
    prose: str = ""  # the text outside code blocks
    shown: dict[str, str] = field(default_factory=dict)  # "my_run.yaml" -> the block's text

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


@cache
def pages() -> tuple[Page, ...]:
    out = []
    for path in PAGES:
        text = path.read_text()
        page = Page(path, text, prose=FENCE.sub("", text))
        for m in FENCE.finditer(text):
            page.blocks.append((m.group(1), m.group(2)))
            first = m.group(2).split("\n", 1)[0]
            if re.fullmatch(r"# [\w./-]+\.(yaml|py)", first):
                page.shown[first[2:]] = m.group(2)
        out.append(page)
    return tuple(out)


def shell_lines(body: str) -> Iterator[str]:
    """A shell block's command lines, continuations joined, comments and output left out."""
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # FOO=bar cmd
            words.pop(0)
        if words:
            yield shlex.join(words)


def commands(page: Page) -> Iterator[list[str]]:
    for lang, body in page.blocks:
        if lang in SHELL:
            for line in shell_lines(body):
                yield shlex.split(line)


def treadle_argv(words: list[str]) -> list[str] | None:
    """The arguments of the treadle command in a command line, or None if it runs no treadle."""
    if words[0] == "ray" and "--" in words:
        words = words[words.index("--") + 1 :]
    if words[0].endswith("/treadle") or words[0] == "treadle":
        return [w.removeprefix("$PWD/") for w in words[1:]]
    if words[0].endswith("python") and words[1:3] == ["-m", "treadle"]:
        return words[3:]
    return None


# ----------------------------------------------------------------------------- code blocks


def _config_of(page: Page, path: str) -> Path | dict | None:
    """The config a command names: a file of the repository, or a YAML block of the page."""
    if (ROOT / path).is_file():
        return ROOT / path
    if path in page.shown:
        return yaml.safe_load(page.shown[path])
    return None


def _check_treadle(page: Page, argv: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parse(argv)
    except SystemExit as done:  # --help exits 0
        return None if done.code == 0 else f"does not parse: {err.getvalue().strip()}"
    target = getattr(args, "config", None) or getattr(args, "target", None)
    if target is None:
        return None
    if not target.endswith(".yaml"):  # treadle eval RUN_DIR or MODEL_DIR: made by a run
        return None if target.startswith("runs/") else f"{target}: not a config nor a run dir"
    config = _config_of(page, target)
    if config is None:
        return f"{target}: no such config in the repository, nor shown on the page"
    try:
        load_config(config, getattr(args, "overrides", []))
    except ConfigError as e:
        return f"{target}: {e}"
    return None


def _check_python(words: list[str]) -> str | None:
    if words[1] == "-m":
        module = words[2]
        return None if importlib.util.find_spec(module) else f"no module {module}"
    script = ROOT / words[1]
    if not script.is_file():
        return f"no file {words[1]}"
    flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
    source = script.read_text()
    missing = [f for f in flags if f'"{f}"' not in source]
    return f"{words[1]} defines no {', '.join(missing)}" if missing else None


def check_command(page: Page, words: list[str]) -> str | None:
    """What is wrong with one command line, or None."""
    argv = treadle_argv(words)
    if argv is not None:
        return _check_treadle(page, argv)
    if words[0] == "make":
        missing = [t for t in words[1:] if t not in make_targets()]
        return f"no make target {', '.join(missing)}" if missing else None
    if words[0].endswith("python") and len(words) > 1:
        return _check_python(words)
    if words[0] == "bash":
        return None if (ROOT / words[1]).is_file() else f"no file {words[1]}"
    return None  # another tool's command (ray start, pip), or a line of output


@cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


def parse(argv: list[str]) -> argparse.Namespace:
    """As ``treadle.cli.parse``, on one parser built once: overrides may follow the options."""
    args, extra = parser().parse_known_args(argv)
    wrong = any(e.startswith("-") or "=" not in e for e in extra)
    if extra and (not hasattr(args, "overrides") or wrong):
        parser().error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    return args


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([\w-]+):", text, re.M))


def test_every_command_in_a_code_block_is_real():
    problems, seen = [], 0
    for page in pages():
        for words in commands(page):
            seen += 1
            if (problem := check_command(page, words)) is not None:
                problems.append(f"{page.name}: `{shlex.join(words)}`: {problem}")
    assert seen > 50  # the guides' commands, not a few
    assert not problems, "\n".join(problems)


def test_every_shown_config_file_is_valid():
    shown = [(p, n, t) for p in pages() for n, t in p.shown.items() if n.endswith(".yaml")]
    assert shown
    for page, name, text in shown:
        load_config(yaml.safe_load(text))  # its keys and values, as a run would read them
        assert any(name in shlex.join(w) for w in commands(page)), f"{page.name}: {name} unused"


# ----------------------------------------------------------------------------- running text


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_inline(words: list[str]) -> str | None:
    """A command in running text: its subcommands exist and its flags are theirs."""
    command, rest = parser(), words[1:]
    while rest and (subs := _subparsers(command)):
        if rest[0] not in subs:
            return f"no subcommand {rest[0]!r} (there are {', '.join(subs)})"
        command, rest = subs[rest[0]], rest[1:]
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    missing = [f for f in flags if f not in command._option_string_actions]
    return f"no option {', '.join(missing)}" if missing else None


def inline_spans(page: Page) -> Iterator[str]:
    yield from re.findall(r"`([^`\n]+)`", page.prose)


def test_every_command_in_running_text_is_real():
    problems, seen = [], 0
    for page in pages():
        for span in inline_spans(page):
            if re.match(r"(\.venv/bin/)?treadle \w", span):
                seen += 1
                words = shlex.split(span.replace("...", ""))
                problem = check_inline(words)
            elif re.match(r"make [\w-]+$", span):
                seen += 1
                problem = check_command(page, span.split())
            elif re.match(r"python (-m )?[\w./]+\.?\w*( |$)", span) and "<" not in span:
                seen += 1
                problem = check_command(page, shlex.split(span))
            else:
                continue
            if problem is not None:
                problems.append(f"{page.name}: `{span}`: {problem}")
    assert seen > 30
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- names and paths


def _defines(module_file: Path, name: str) -> bool:
    """The module binds ``name`` (a def, a class, an import, an assignment) or names it as a
    string, as a table of lazy imports does (``_LAZY = {"train": "treadle.api"}``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return name in names


def check_dotted(name: str) -> str | None:
    """``treadle.a.b.c``: the longest prefix that is a module exists, and defines the rest."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        attrs = parts[i:]
        if not attrs:
            return None
        origin = Path(spec.origin or "")
        if len(attrs) == 1 and origin.is_file() and _defines(origin, attrs[0]):
            return None
        return f"{module} defines no {'.'.join(attrs)}"
    return "no such module"


def test_every_treadle_name_exists():
    names = {
        (page.name, m)
        for page in pages()
        for m in re.findall(r"\btreadle(?:\.[A-Za-z_]\w*)+", page.text)
    }
    assert len(names) > 10
    problems = [f"{p}: {n}: {err}" for p, n in sorted(names) if (err := check_dotted(n))]
    assert not problems, "\n".join(problems)


# a file (it has an extension) or a folder (a trailing slash); `ratio treadle/trl` is neither
PATH = re.compile(
    r"(?<![\w/.~$-])((?:treadle|tests|bench|examples|docs)/(?:[\w{},-]+/)*(?:[\w{},-]*\.[\w{},]+)?)"
)


def expand(path: str) -> list[str]:
    """``a/{b,c}.yaml`` -> ``a/b.yaml``, ``a/c.yaml``."""
    parts = re.split(r"\{([^}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_every_path_named_exists():
    problems, seen = [], 0
    for page in pages():
        for m in PATH.finditer(page.text):
            for path in expand(m.group(1).rstrip(".")):
                seen += 1
                if not (ROOT / path).exists():
                    problems.append(f"{page.name}: {path}")
    assert seen > 100
    assert not problems, "no such file:\n" + "\n".join(sorted(set(problems)))


def _is_key(model: type[BaseModel], parts: list[str]) -> bool:
    fields = {f.alias or n: f for n, f in model.model_fields.items()}
    if parts[0] not in fields:
        return False
    sub = fields[parts[0]].annotation
    if len(parts) == 1 or not (isinstance(sub, type) and issubclass(sub, BaseModel)):
        return True  # a leaf; what follows is its value (a dict's keys, say)
    return _is_key(sub, parts[1:])


def test_every_config_key_named_exists():
    sections = "|".join(f.alias or n for n, f in Config.model_fields.items())
    key = re.compile(rf"`((?:{sections})\.[a-z_][\w.]*)")
    problems, seen = [], 0
    for page in pages():
        if page.path.parent.parent.name == "examples":  # they name verl's keys, a model's layers
            continue
        for found in key.findall(page.text):
            span = found.rstrip(".")
            if re.search(r"\.(yaml|jsonl?|py|md)$", span):  # a file: dpo.yaml
                continue
            seen += 1
            if not _is_key(Config, span.split(".")):
                problems.append(f"{page.name}: {span}")
    assert seen > 200
    assert not problems, "not config keys:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- the README


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    screen = "\n".join(lines[:FIRST_SCREEN])
    first = Page(README, screen, prose=FENCE.sub("", screen))
    first.blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(screen)]
    shown = [shlex.join(w) for w in commands(first)]
    assert shown == ["make demo", "make test"], shown
    named = {s for s in inline_spans(first) if re.match(r"(make|treadle|python|\.venv/)\S* ", s)}
    assert named <= {"make demo", "make test"}, f"other commands on the first screen: {named}"
    assert "held-out accuracy: sft=" in first.text  # and what the demo prints


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) > 20
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


@pytest.mark.parametrize(
    ("words", "problem"),
    [
        (["treadle", "trian", "examples/arithmetic/grpo.yaml"], "does not parse"),
        (["treadle", "train", "examples/arithmetic/nope.yaml"], "no such config"),
        (["treadle", "train", "examples/arithmetic/grpo.yaml", "trainer.total_step=2"], "total"),
        (["make", "tests"], "no make target tests"),
        (["python", "bench/rollout.py", "--no-such-flag"], "defines no --no-such-flag"),
    ],
)
def test_a_wrong_command_is_caught(words, problem):
    page = Page(README, "")
    assert problem in (check_command(page, words) or "")


def test_a_wrong_name_is_caught():
    assert check_dotted("treadle.cli.commands.STOP_GRACE_S") is not None  # it is in cli.signals
    assert check_dotted("treadle.cli.signals.STOP_GRACE_S") is None
    assert check_inline(["treadle", "check", "CONFIG", "--knd", "train"]) is not None
    assert not _is_key(Config, ["trainer", "keep_lst"])
