"""The Python API: ``treadle.train``, ``treadle.distill``, ``treadle.sft``, ``treadle.dpo``,
``treadle.kto`` and ``treadle.rm``.

Each runs what the command of the same name runs, from Python::

    import treadle

    result = treadle.train(
        "examples/arithmetic/grpo.yaml",        # a YAML file, a dict of sections or a Config
        reward=my_reward,                       # a function, or a spec string as in the YAML
        train_dataset=my_dataset,               # a datasets.Dataset, a file or a saved folder
        overrides=["trainer.total_steps=20"],   # section.key=value, as on the command line
    )
    result.metrics["reward/mean"], result.final_model

The choices it makes:

- The config goes through the command line's path (``load_config``: unknown keys, bad values
  and broken rules, every one listed; then ``treadle.check.run``), so a mistake reads the same
  whichever way the run was started; the errors are raised (a
  :class:`~treadle.runtime.errors.TreadleError`), not printed.
- A reward function is registered in this process
  (:func:`treadle.rewards.functions.register_reward`) and named in the config
  ``python:<module>.<name>``. Its form is read from its signature:
  ``fn(prompt, response, ground_truth) -> float`` per sample, or TRL's batched
  ``fn(completions, **columns) -> list[float]``. Rewards are scored on the driver, so this
  holds with ``trainer.backend=ray`` too; a per-sample function is sent to the
  ``reward.num_workers`` scoring processes by cloudpickle, keeping their time limit and crash
  isolation (``reward.num_workers=0`` calls it in this process).
- A ``datasets.Dataset`` is written once with ``save_to_disk`` to
  ``<output_dir>/datasets/train`` (``val``) and the config names that folder, so the data goes
  through the same row checks as a file, Ray workers need nothing of this process, the resolved
  ``config.yaml`` says what ran, and running the same call again resumes (a dataset whose
  fingerprint is unchanged is not written again). A path is used as given: JSONL, Parquet, or
  a folder written by ``save_to_disk``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from treadle.config import Config, load_config
from treadle.runtime.errors import ConfigError

if TYPE_CHECKING:
    from datasets import Dataset

ConfigLike = str | os.PathLike[str] | Mapping[str, Any] | Config | None
RewardLike = Callable[..., Any] | str | None
Kind = Literal["train", "distill", "sft", "dpo", "kto", "rm"]


@dataclass(frozen=True)
class RunResult:
    """What a run returns: the last step's metrics and where it wrote."""

    metrics: dict[str, float]
    output_dir: Path

    @property
    def final_model(self) -> Path:
        """The trained model, an ordinary Hugging Face folder."""
        return self.output_dir / "final_model"


class Driver(Protocol):
    """``treadle.train``, ``sft``, ``dpo`` and ``kto``: what the command of the same name runs.

    ``config``: a YAML file, a dict of sections (as the YAML holds them) or a ``Config``;
    ``reward``: a function (see the module's docstring) or a ``reward.function`` spec;
    ``train_dataset``/``eval_dataset``: a ``datasets.Dataset``, a file or a saved dataset
    folder, or a list of files (``data.train_files``/``data.val_files``); ``overrides``:
    ``section.key=value`` strings applied to ``config``.
    """

    def __call__(
        self,
        config: ConfigLike = None,
        *,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        reward: RewardLike = None,
        overrides: Sequence[str] = (),
    ) -> RunResult: ...


def _driver(kind: Kind, doc: str) -> Driver:
    def run(
        config: ConfigLike = None,
        *,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        reward: RewardLike = None,
        overrides: Sequence[str] = (),
    ) -> RunResult:
        return _run(kind, config, reward, train_dataset, eval_dataset, overrides)

    run.__name__ = run.__qualname__ = kind
    run.__doc__ = f"{doc}\n\n    Arguments as :class:`Driver` says.\n    "
    return run


train = _driver("train", "RL training (GRPO and the PPO family), as ``treadle train``.")
distill = _driver(
    "distill",
    "Distillation from ``teacher.model_path`` (``distill.loss``: on-policy reverse KL, GKD or "
    "sequence-level KD), as ``treadle distill``; ``reward`` scores samples and held-out sets.",
)
sft = _driver(
    "sft", "Supervised fine-tuning, as ``treadle sft``; ``reward`` scores held-out accuracy."
)
dpo = _driver(
    "dpo", "DPO on chosen/rejected pairs, as ``treadle dpo``; ``reward`` scores ``dpo.eval_task``."
)
kto = _driver(
    "kto",
    "KTO on unpaired examples ({prompt, completion, label: bool}; or pairs), as ``treadle kto``; "
    "``reward`` scores ``kto.eval_task``.",
)


def rm(
    config: ConfigLike = None,
    *,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    overrides: Sequence[str] = (),
) -> RunResult:
    """A Bradley-Terry reward model on chosen/rejected pairs, as ``treadle rm``."""
    return _run("rm", config, None, train_dataset, eval_dataset, overrides)


def resolve_config(
    config: ConfigLike,
    overrides: Sequence[str] = (),
    *,
    reward: RewardLike = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
) -> Config:
    """The run's config: ``config`` with ``overrides``, the reward's spec and the datasets'
    paths (a ``datasets.Dataset`` is written under ``<output_dir>/datasets/``)."""
    if isinstance(config, Config):
        raw: Any = config.model_dump(mode="json", by_alias=True)
    elif isinstance(config, str | os.PathLike) or config is None or isinstance(config, Mapping):
        raw = config
    else:
        raise ConfigError(
            f"config: a {type(config).__name__}; give a YAML file's path, a dict of sections "
            "or a treadle Config"
        )
    extra = list(overrides)
    if reward is not None:
        extra.append(f"reward.function={_reward_spec(reward)}")
    cfg = load_config(raw, extra)
    out = Path(cfg.trainer.output_dir)
    updates: dict[str, list[str]] = {}
    for field, value, split in (
        ("train_files", train_dataset, "train"),
        ("val_files", eval_dataset, "val"),
    ):
        if value is not None:
            updates[field] = _data_paths(value, out, split, f"data.{field}")
    if updates:
        cfg = load_config(
            cfg.model_dump(mode="json", by_alias=True) | {"data": cfg.data.model_dump() | updates}
        )
    return cfg


def _run(
    kind: Kind,
    config: ConfigLike,
    reward: RewardLike,
    train_dataset: Any,
    eval_dataset: Any,
    overrides: Sequence[str],
) -> RunResult:
    from treadle.check.run import check

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = resolve_config(
        config, overrides, reward=reward, train_dataset=train_dataset, eval_dataset=eval_dataset
    )
    check(cfg, kind)
    metrics = _trainer(kind)(cfg)
    return RunResult(metrics=metrics, output_dir=Path(cfg.trainer.output_dir))


def _trainer(kind: Kind) -> Callable[[Config], dict[str, float]]:
    if kind == "train":
        from treadle.trainers.rl import train as run
    elif kind == "distill":
        from treadle.trainers.distill import distill as run
    elif kind == "sft":
        from treadle.trainers.sft import sft as run
    elif kind == "dpo":
        from treadle.trainers.dpo import dpo as run
    elif kind == "kto":
        from treadle.trainers.kto import kto as run
    else:
        from treadle.trainers.rm import rm as run
    return run


def _reward_spec(reward: Callable[..., Any] | str) -> str:
    from treadle.rewards import register_reward

    if isinstance(reward, str):
        return reward
    return register_reward(reward)


def _data_paths(value: Any, out: Path, split: str, key: str) -> list[str]:
    """``value`` as the paths the config lists; a Dataset is saved to disk first."""
    from datasets import Dataset, DatasetDict

    if isinstance(value, DatasetDict):
        raise ConfigError(
            f"{key}: a DatasetDict ({', '.join(value)}); give one split, e.g. dataset['train']"
        )
    if isinstance(value, Dataset):
        return [str(_save_dataset(value, out / "datasets" / split, key))]
    if isinstance(value, str | os.PathLike):
        return [os.fspath(value)]
    if isinstance(value, Sequence) and all(isinstance(v, str | os.PathLike) for v in value):
        return [os.fspath(v) for v in value]
    raise ConfigError(
        f"{key}: a {type(value).__name__}; give a datasets.Dataset, a JSONL or Parquet file, a "
        "folder written by Dataset.save_to_disk, or a list of files"
    )


def _save_dataset(ds: Dataset, dest: Path, key: str) -> Path:
    """``ds`` in ``dest`` (written by ``save_to_disk``), unless it holds the same data."""
    fingerprint = getattr(ds, "_fingerprint", None)
    state = dest / "state.json"
    if fingerprint and state.is_file():
        try:
            if json.loads(state.read_text()).get("_fingerprint") == fingerprint:
                return dest.absolute()
        except (OSError, ValueError):
            pass  # unreadable: write it again
    from datasets.utils import logging as dslog

    from treadle.trainers.run_dir import RunLock

    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = RunLock(dest.parent.parent)  # not under a live run's feet
    try:
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        bars = dslog.is_progress_bar_enabled()
        dslog.disable_progress_bar()  # a "Saving the dataset" bar per run is noise
        try:
            ds.save_to_disk(str(tmp))
        except Exception as e:  # columns arrow cannot store, a full disk ...
            raise ConfigError(f"{key}: cannot save the Dataset to '{tmp}': {e}") from None
        finally:
            if bars:
                dslog.enable_progress_bar()
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        lock.release()
    return dest.absolute()
