"""``trainer``: the run: backend, steps, checkpoints, logging."""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from treadle.config.base import Key, Section

LoggerName = Literal["console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab"]


def _default_loggers() -> list[LoggerName]:
    return ["console", "jsonl"]


class TrainerConfig(Section):
    backend: Literal["ray", "local"] = Field(
        "ray", description="'ray': worker groups as Ray actors; 'local': one rank in-process."
    )
    output_dir: Key = Field("runs/default", description="Run directory (metrics, checkpoints).")
    total_steps: int = Field(10, gt=0, description="RL (or SFT) steps after which the run ends.")
    epochs: int | None = Field(None, gt=0, description="SFT: train for this many epochs instead.")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: only at the end).")
    keep_last: int = Field(
        2,
        gt=0,
        description="Newest checkpoints kept on disk; an older one is removed only after a "
        "newer one is sealed, and never the trainer.keep_best one.",
    )
    keep_best: str | None = Field(
        None,
        description="Keep the checkpoint with the best value of this evaluation metric "
        "(eval/<set>/<metric>, e.g. eval/val/accuracy), whatever trainer.keep_last removes; "
        "every save step must be an eval step (trainer.eval_every divides "
        "trainer.save_every). Each checkpoint's state.json records its step's eval metrics, "
        "so the ranking survives a resume. null: no best is kept.",
    )
    keep_best_mode: Literal["max", "min"] | None = Field(
        None,
        description="Whether a higher (max) or lower (min) trainer.keep_best is better; "
        "null: min when the metric's name says loss, perplexity or error, else max. A tie "
        "keeps the earlier checkpoint.",
    )
    final_model: Literal["last", "best"] = Field(
        "last",
        description="What <output_dir>/final_model is at the end: the last step's model, or "
        "the best sealed checkpoint's by trainer.keep_best (which it needs).",
    )
    save_optimizer: bool = Field(
        True,
        description="Checkpoints hold the optimizer state (about twice the trained weights); "
        "false: they do not, and a resume starts the optimizer afresh (with a warning).",
    )
    eval_every: int = Field(0, ge=0, description="Evaluate held-out accuracy every N steps.")
    seed: int = Field(
        0, ge=0, lt=2**32, description="Seed of data order, sampling and initialisation."
    )
    resume: bool = Field(True, description="Resume from the newest complete checkpoint.")
    num_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs the run uses (default: all of this machine, or of the cluster).",
    )
    ray_address: str | None = Field(
        None,
        description="Join this running Ray cluster ('host:port', 'auto') instead of starting "
        "one; null: the RAY_ADDRESS environment variable if set, else a new local cluster.",
    )
    threads_per_rank: int | None = Field(
        None, gt=0, description="torch threads per rank (default: cores / ranks, at least 1)."
    )
    progress: bool = Field(
        True,
        description="On a terminal, show a progress bar (false: one plain line per step, as "
        "when the output is not a terminal).",
    )
    ray_dashboard: bool = Field(
        False, description="Start Ray's dashboard (on 127.0.0.1) with the local cluster."
    )
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="RL: 'sync' generates, then trains, step after step; 'one_step_off' "
        "generates step t+1's samples with the weights before step t's update while step t "
        "trains; 'async' lets the replicas generate without pause into a buffer the trainer "
        "takes batches from (bounded by the 'async' section). The last two need "
        "rollout.placement=split.",
    )
    loggers: list[LoggerName] = Field(
        default_factory=_default_loggers,
        description="Where metrics go: 'console' (progress bar on a terminal, one line per "
        "step otherwise), 'jsonl' (<output_dir>/metrics.jsonl and samples.jsonl, which "
        "`treadle report` reads), "
        "'tensorboard' (<output_dir>/tensorboard/), 'wandb' (<output_dir>/wandb/, offline "
        "unless WANDB_MODE or WANDB_API_KEY is set), 'mlflow' (sqlite:///<output_dir>/"
        "mlflow.db unless MLFLOW_TRACKING_URI is set), 'swanlab' (local, <output_dir>/"
        "swanlog/, unless SWANLAB_MODE is set).",
    )
    log_samples_every: int = Field(
        10,
        ge=0,
        description="RL: every N steps (and at the last) write trainer.log_samples prompts, "
        "responses, rewards and ground truths to <output_dir>/samples.jsonl and the trackers' "
        "tables (0: never).",
    )
    log_samples: int = Field(4, ge=1, description="Samples written each time they are due.")
    profile_steps: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=list,
        description="Steps whose work torch.profiler records, in the driver's process and "
        "(on Ray) each training rank's and split rollout replica's: "
        "<output_dir>/profile/step_<n>/<process>.json.gz, a "
        "trace to open in Perfetto (ui.perfetto.dev), and <process>.txt, a table of the "
        "step's treadle/ ranges, the device's kernels and the CPU's operators by time. A "
        "profiled step runs slower; leave it out of timings.",
    )
    verbose: bool = Field(
        False,
        description="Show Ray's, vLLM's and torch's messages on the console; otherwise they go "
        "to <output_dir>/logs/ (every command's --verbose sets it).",
    )

    @field_validator("output_dir")
    @classmethod
    def _home(cls, value: str) -> str:
        """``~`` is the user's home, for the run as for ``treadle check`` (which created the
        directory it names: a run that kept ``~`` wrote to ``./~``)."""
        return os.path.expanduser(value)

    @model_validator(mode="after")
    def _profile_steps_in_the_run(self) -> TrainerConfig:
        late = [s for s in self.profile_steps if self.epochs is None and s > self.total_steps]
        if late:
            raise ValueError(
                f"trainer.profile_steps names step {late[0]}, after the run's last "
                f"(trainer.total_steps={self.total_steps}): name steps 1 to {self.total_steps}"
            )
        return self

    @field_validator("keep_best")
    @classmethod
    def _an_eval_metric(cls, value: str | None) -> str | None:
        parts = value.split("/") if value is not None else []
        if value is not None and (parts[0] != "eval" or len(parts) < 2 or not all(parts)):
            raise ValueError(
                "name an evaluation metric as eval/<set>/<metric>, e.g. eval/val/accuracy"
            )
        return value

    def best_mode(self) -> Literal["max", "min"]:
        """``keep_best_mode``, or the one the metric's name implies (min for a loss)."""
        if self.keep_best_mode is not None:
            return self.keep_best_mode
        last = (self.keep_best or "").rsplit("/", 1)[-1].lower()
        lower = any(word in last for word in ("loss", "perplexity", "error"))
        return "min" if lower else "max"
