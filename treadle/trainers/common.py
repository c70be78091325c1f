"""What every driver needs before its loop: the run directory, Ray, the worker group, resume.

Kept out of the loops so that each trainer's file reads as its dataflow.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import math
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from treadle import checkpoint as ckpt
from treadle import startup
from treadle.cluster import ensure_ray, total_cpus
from treadle.config import Config, dump_config
from treadle.controller import ResourcePool, Worker, WorkerGroup
from treadle.data import PromptDataset, ResumableSampler, collate_prompts, config_prompts
from treadle.engines.rollout import SamplingParams
from treadle.errors import ConfigError, Stopped, WorkerDied, raise_if_signalled, stop_cause
from treadle.faults import failpoint
from treadle.models import ADAPTER_DIR, export_merged, load_tokenizer
from treadle.protocol import Batch
from treadle.rewards import Scorer
from treadle.rollout.client import RolloutError
from treadle.trackers import ConsoleLogger, check_loggers
from treadle.tracking import Tracker, quiet_start, route_logs, worker_env
from treadle.workers import ActorRolloutRefWorker

if TYPE_CHECKING:
    from treadle.trainers.rollout import Rollout

log = logging.getLogger("treadle")


class RunLock:
    """``<output_dir>/.lock``: held (``flock``) by the run working on the directory, with its
    pid inside. A second run stops at once naming the holder; the lock of a run that died
    goes with its process and is taken over with a warning."""

    def __init__(self, out: Path) -> None:
        self.path = out / ".lock"
        self.file = self.path.open("a+")
        self.file.seek(0)
        holder = self.file.read().strip()
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise ConfigError(
                f"{out} is in use by another run ({holder or 'pid unknown'}): wait for it to "
                "end or stop it, or set trainer.output_dir to another directory"
            ) from None
        if holder:
            log.warning(
                "%s: took over the lock of a run that ended without releasing it (%s)", out, holder
            )
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            self.file.seek(0)
            self.file.truncate()
            self.file.close()  # closing releases the flock


def prepare_run_dir(cfg: Config) -> tuple[Path, RunLock]:
    """The run directory, locked, with the resolved config written into it."""
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)
    dump_config(cfg, out / "config.yaml")
    return out, lock


def resume_point(cfg: Config) -> tuple[Path | None, str]:
    """(newest complete checkpoint or None, the folder the actor starts from)."""
    latest = ckpt.latest_checkpoint(cfg.trainer.output_dir) if cfg.trainer.resume else None
    if latest is not None:  # LoRA: the base model, its adapters are loaded on resume
        return latest, cfg.model.path if ckpt.holds_adapters(latest) else str(latest / "model")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a local Hugging Face model folder")
    return None, cfg.model.path


@dataclass
class Actors:
    """The actor+rollout+reference worker group, the pool it lives in, and the groups of the
    other roles (critic, reward model), on that pool's bundles or on pools of their own."""

    group: WorkerGroup
    pool: ResourcePool | None
    share: float = 1.0  # of each bundle, taken by every group colocated on ``pool``
    others: list[tuple[WorkerGroup, ResourcePool | None]] = field(default_factory=list)

    def close(self) -> None:
        for group, pool in reversed(self.others):
            group.shutdown()
            if pool is not None:
                pool.remove()
        self.group.shutdown()
        if self.pool is not None:
            self.pool.remove()


def rank_threads(cfg: Config, cpus_per_rank: float) -> int:
    return cfg.trainer.threads_per_rank or max(1, int(cpus_per_rank))


def ray_env(threads: int) -> dict[str, str]:
    env = {
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
    }
    return {**env, **worker_env()}  # not verbose: the worker writes to <output_dir>/logs/


def _gpus_per_rank() -> float:
    return 1.0 if torch.cuda.is_available() else 0.0


def build_actors(
    cfg: Config,
    actor_path: str,
    with_ref: bool,
    colocated: int = 1,
    cpus_per_rank: float | None = None,
) -> Actors:
    """The actor+rollout+reference group, starting from the weights at ``actor_path``."""
    kwargs = {"actor_path": actor_path, "with_ref": with_ref}
    return build_group(cfg, ActorRolloutRefWorker, kwargs, colocated, cpus_per_rank)


def build_group(
    cfg: Config,
    worker_cls: type[Worker],
    kwargs: dict[str, Any],
    colocated: int = 1,
    cpus_per_rank: float | None = None,
) -> Actors:
    """``actor.world_size`` ranks of ``worker_cls`` (one in-process rank for the local backend).

    Every worker is built with ``config`` and ``threads`` besides ``kwargs``. ``colocated``:
    how many groups will share the pool's bundles (each takes 1/colocated of a bundle);
    ``cpus_per_rank``: a bundle's CPUs (default: all / ranks).
    """
    ws = cfg.actor.world_size
    cpus = cpus_per_rank or total_cpus(cfg) / ws
    threads = rank_threads(cfg, cpus)
    kwargs = {"config": cfg, "threads": threads, **kwargs}
    if cfg.trainer.backend == "local":
        group = WorkerGroup(worker_cls, world_size=1, backend="local", kwargs=kwargs)
        return Actors(group, None)
    ensure_ray(cfg)
    pool = ResourcePool(world_size=ws, cpus_per_rank=cpus, gpus_per_rank=_gpus_per_rank())
    try:
        group = WorkerGroup(
            worker_cls,
            world_size=ws,
            backend="ray",
            pool=pool,
            kwargs=kwargs,
            env=ray_env(threads),
            share=1.0 / colocated,
        )
    except BaseException:
        pool.remove()  # give the CPUs back: a failed start must not starve what comes next
        raise
    return Actors(group, pool, share=1.0 / colocated)


def add_group(
    actors: Actors,
    cfg: Config,
    cls: type[Worker],
    kwargs: dict[str, Any],
    *,
    world_size: int,
    own_cpus_per_rank: float | None = None,
) -> WorkerGroup:
    """Another role's group: on the actors' bundles (colocated, the same share each) or, given
    ``own_cpus_per_rank``, on a pool of its own (split). Closed with the actors."""
    if cfg.trainer.backend == "local":  # joins the actor's one-rank process group in-process
        threads = rank_threads(cfg, total_cpus(cfg))  # the process's: the actor's too
        group = WorkerGroup(
            cls, world_size=1, backend="local", kwargs={**kwargs, "threads": threads}
        )
        actors.others.append((group, None))
        return group
    assert actors.pool is not None
    own = own_cpus_per_rank is not None
    pool = (
        ResourcePool(world_size, cpus_per_rank=own_cpus_per_rank, gpus_per_rank=_gpus_per_rank())
        if own_cpus_per_rank is not None
        else actors.pool
    )
    threads = rank_threads(cfg, pool.cpus_per_rank)
    try:
        group = WorkerGroup(
            cls,
            world_size=world_size,
            backend="ray",
            pool=pool,
            kwargs={**kwargs, "threads": threads},
            env=ray_env(threads),
            share=1.0 if own else actors.share,
        )
    except BaseException:
        if own:
            pool.remove()
        raise
    actors.others.append((group, pool if own else None))
    return group


def load_prompts(cfg: Config, files: list[str], key: str) -> PromptDataset:
    if not files:
        raise ConfigError(f"{key} is empty: list at least one JSONL or Parquet file")
    tok = load_tokenizer(
        cfg.model.tokenizer_path or cfg.model.path, allow_download=cfg.model.allow_download
    )
    return config_prompts(cfg, files, key, tok, tool_schemas(cfg))


def tool_schemas(cfg: Config) -> list[dict[str, Any]] | None:
    """The JSON schemas of ``rollout.tools``, which the prompts show the model."""
    from treadle.agents.tools import Toolbox

    return Toolbox.load(cfg.rollout.tools).schemas if cfg.rollout.tools else None


def prompt_batch(ds: PromptDataset, indices: list[int], pad_id: int, **meta: Any) -> Batch:
    rows = [ds[i] for i in indices]
    ids, mask = collate_prompts([r["prompt_ids"] for r in rows], pad_id)
    return Batch.from_dict(
        tensors={"prompts": ids, "prompt_mask": mask},
        objects={
            "uid": [r["uid"] for r in rows],
            "prompt_text": [r["prompt_text"] for r in rows],
            "ground_truth": [r["ground_truth"] for r in rows],
            "row": [r["row"] for r in rows],
        },
        meta=meta,
    )


def left_pad(batch: Batch, width: int) -> Batch:
    """``prompts``/``prompt_mask`` left-padded to ``width`` columns (to concat rounds)."""
    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    out = batch.select(list(range(len(batch))))
    out["prompts"] = torch.nn.functional.pad(batch["prompts"], (extra, 0), value=0)
    out["prompt_mask"] = torch.nn.functional.pad(batch["prompt_mask"], (extra, 0), value=0)
    return out


def evaluate(
    cfg: Config, rollout: Rollout, ds: PromptDataset, pad_id: int, scorer: Scorer
) -> float:
    """Held-out accuracy (fraction of reward 1.0) with greedy decoding, one sample each."""
    n = len(ds) if cfg.data.val_size is None else min(cfg.data.val_size, len(ds))
    batch = prompt_batch(ds, list(range(n)), pad_id)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
    failpoint("eval")
    out = rollout.generate(batch, greedy)
    scores = rule_scores(scorer, out)
    return sum(1.0 for s in scores if s >= 1.0) / max(len(scores), 1)


def make_scorer(cfg: Config) -> Scorer:
    """``reward.function``, called as ``reward.num_workers`` and ``reward.timeout_s`` say."""
    r = cfg.reward
    return Scorer(r.function, r.num_workers, r.timeout_s)


def rule_scores(scorer: Scorer, batch: Batch) -> list[float]:
    """The reward function's score of every sample of ``batch`` (a batched reward also gets
    the columns of the data rows)."""
    rows = list(batch["row"]) if "row" in batch else None
    return scorer(
        list(batch["prompt_text"]), list(batch["response_text"]), list(batch["ground_truth"]), rows
    )


def save_checkpoint(
    cfg: Config,
    group: WorkerGroup,
    step: int,
    driver_state: dict,
    final: bool,
    roles: Mapping[str, WorkerGroup] | None = None,
) -> Path:
    """Checkpoint ``step`` atomically; the final one is also exported as ``final_model``.

    The actor's group writes the top of the directory, each of ``roles`` its own ``<name>/``;
    ``driver_state`` (the data position and whatever else the driver keeps) goes to state.json.
    """
    tmp = ckpt.begin(cfg.trainer.output_dir, step)
    group.save_checkpoint(str(tmp))
    for name, role in (roles or {}).items():
        role.save_checkpoint(str(tmp / name))
    failpoint("checkpoint", step)
    done = ckpt.commit(tmp, {"step": step, **driver_state}, cfg.trainer.keep_checkpoints)
    if final:
        export_model(done, Path(cfg.trainer.output_dir) / "final_model")
    return done


def export_model(checkpoint_dir: Path, dest: Path) -> Path:
    """Copy the checkpoint's model folder to ``dest`` (the run's final model): files of its
    own, which checkpoint rotation cannot touch."""
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if ckpt.holds_adapters(checkpoint_dir):  # LoRA: merged, with the adapter in adapter/
        export_merged(checkpoint_dir / ADAPTER_DIR, tmp)
    else:
        shutil.copytree(checkpoint_dir / "model", tmp)
    tmp.rename(dest)
    return dest


def evaluate_model(cfg: Config) -> float:
    """Held-out accuracy of ``model.path`` (a model folder or a checkpoint's model)."""
    if not cfg.data.val_files:
        raise ConfigError("data.val_files is empty: eval needs held-out prompts")
    val = load_prompts(cfg, cfg.data.val_files, "data.val_files")
    if not cfg.model.path:
        raise ConfigError("model.path is empty: give a local Hugging Face model folder")
    from treadle.trainers.rollout import start_rollout

    # A one-off greedy pass: the replicas live in the actor's processes whatever the placement.
    colocated = cfg.rollout.model_copy(
        update={"placement": "colocated", "replicas": None, "num_cpus": None, "ray_resources": {}}
    )
    cfg = cfg.model_copy(update={"rollout": colocated})
    actors = build_actors(cfg, cfg.model.path, with_ref=False)
    try:
        rollout = start_rollout(cfg, actors, cfg.model.path, 0)
        try:
            with make_scorer(cfg) as scorer:
                return evaluate(cfg, rollout, val, val.pad_id, scorer)
        finally:
            rollout.close()
    finally:
        actors.close()


class Trainer:
    """The loop every driver shares: resume, steps, metrics, checkpoints, clean-up.

    A subclass loads its data, calls :meth:`start_workers`, and defines :meth:`run_step`
    (one step's metrics) and ``total`` (the last step).
    """

    headline = "reward/mean"
    algorithm = "training"  # what the start-up line says it runs

    def __init__(self, cfg: Config) -> None:
        startup.begin()
        check_loggers(cfg.trainer.loggers)  # a missing tracker library: before anything starts
        self.cfg = cfg
        self.out, self.lock = prepare_run_dir(cfg)
        self.total = cfg.trainer.total_steps
        self.start = 0
        self.resumed_from: Path | None = None
        # Groups besides the actor's whose state a checkpoint holds, in <checkpoint>/<name>/.
        self.roles: dict[str, WorkerGroup] = {}
        self.rollout: Rollout  # set by start_workers, for workers that serve rollouts
        # rows for the trackers' "samples" table, left by run_step when they are due
        self.samples: list[dict[str, Any]] = []
        self.console: ConsoleLogger | None = None
        self._restore_logs = lambda: None

    def start_workers(
        self,
        sampler: ResumableSampler,
        with_ref: bool,
        colocated: int = 1,
        cpus_per_rank: float | None = None,
    ) -> None:
        """Build the actor group, from the newest complete checkpoint if there is one.

        ``colocated`` and ``cpus_per_rank`` as in :func:`build_actors`.
        """
        self.sampler = sampler
        startup.mark("data")
        latest, actor_path = resume_point(self.cfg)
        if latest is not None:
            state = ckpt.read_state(latest)
            self.start, self.resumed_from = int(state["step"]), latest
            self.load_driver_state(state)
        self.say_what_runs()
        self._restore_logs = route_logs(self.out, self.cfg.trainer.verbose)
        try:
            with quiet_start():
                self._start_workers(actor_path, latest, with_ref, colocated, cpus_per_rank)
        except BaseException:
            self._restore_logs()
            raise
        failpoint("startup")

    def say_what_runs(self) -> None:
        """The start-up lines: what runs, where, and where it writes."""
        t = self.cfg.trainer
        if "console" not in t.loggers:
            return
        self.console = ConsoleLogger(self.total, self.start, self.headline, bar=None)
        self.console.bar = self.console.bar and t.progress
        if t.backend == "local":
            where = "in this process (trainer.backend=local)"
        else:
            device = "GPU" if torch.cuda.is_available() else "CPU"
            where = f"on Ray, {self.cfg.actor.world_size} {device} rank(s)"
        files = ["config.yaml", "logs/"]
        named = {"jsonl": "metrics.jsonl", "mlflow": "mlflow.db", "swanlab": "swanlog/"}
        if os.environ.get("MLFLOW_TRACKING_URI"):
            named["mlflow"] = f"mlflow at {os.environ['MLFLOW_TRACKING_URI']}"
        files += [named.get(n, f"{n}/") for n in t.loggers if n != "console"]
        lines = [
            f"treadle: {self.algorithm} of {self.cfg.model.path}, {self.total} "
            f"step{'s' if self.total != 1 else ''}, {where}",
            f"  writes to {self.out}: {', '.join(files)}",
        ]
        if self.resumed_from is not None:
            lines.append(f"  resumed from {self.resumed_from} (step {self.start})")
        for line in lines:
            self.console.print(line)

    def _start_workers(
        self,
        actor_path: str,
        latest: Path | None,
        with_ref: bool,
        colocated: int,
        cpus_per_rank: float | None,
    ) -> None:
        from treadle.trainers.rollout import reserve_rollout_pool, start_rollout
        from treadle.workers.rollout import ServesRollout

        pool = reserve_rollout_pool(self.cfg)  # split: before the actor's pool (see there)
        try:
            self.actors = self.build_workers(actor_path, with_ref, colocated, cpus_per_rank)
            self.group = self.actors.group
            startup.mark("workers")  # colocated vLLM engines start in the workers
            startup.detail("workers", self.group.startup_seconds())
            try:
                if latest is not None:
                    self.group.load_checkpoint(str(latest))
                    startup.mark("resume")
                if issubclass(self.group.worker_cls, ServesRollout):  # not the RM trainer's
                    given, pool = pool, None  # the rollout's from here, removed by it
                    self.rollout = start_rollout(
                        self.cfg, self.actors, actor_path, self.start, given
                    )
                    if latest is not None and ckpt.holds_adapters(latest):
                        self.rollout.sync_weights(self.start)  # started from the base
                    startup.mark("rollout")
            except BaseException:
                self.actors.close()
                raise
        finally:
            if pool is not None:
                pool.remove()

    def build_workers(
        self,
        start_path: str,
        with_ref: bool,
        colocated: int = 1,
        cpus_per_rank: float | None = None,
    ) -> Actors:
        """The trained worker group, from the weights at ``start_path`` (default: the actor)."""
        return build_actors(self.cfg, start_path, with_ref, colocated, cpus_per_rank)

    def run_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def driver_state(self) -> dict[str, Any]:
        """What the driver itself must keep across a resume (saved in state.json)."""
        return {"sampler": self.sampler.state_dict()}

    def load_driver_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def eval_due(self, step: int) -> bool:
        every = self.cfg.trainer.eval_every
        return step == self.total or bool(every and step % every == 0)

    def fit(self) -> dict[str, float]:
        """Run until ``total``; returns the last step's metrics. Ctrl-C (or SIGTERM, from the
        command line) stops it with :class:`Stopped`, after the workers are shut down."""
        t, metrics = self.cfg.trainer, {}
        step = self.start
        try:
            with self.open_tracker() as tracker:
                started = startup.startup_metrics()
                for step in range(self.start + 1, self.total + 1):
                    failpoint("begin", step)
                    metrics = {**self.run_step(step), **started}
                    raise_if_signalled()  # one whose exception was lost in the step
                    started = {}
                    tracker.log(step, metrics)
                    if self.samples:
                        tracker.log_table(step, "samples", self.samples)
                        self.samples = []
                    failpoint("step", step)
                    if not all(math.isfinite(v) for v in metrics.values()):
                        raise FloatingPointError(f"step {step}: a metric is not finite: {metrics}")
                    last = step == self.total
                    if last or (t.save_every and step % t.save_every == 0):
                        state = self.driver_state()
                        save_checkpoint(
                            self.cfg, self.group, step, state, final=last, roles=self.roles
                        )
                        failpoint("sealed", step)
        except KeyboardInterrupt as e:
            how, code = stop_cause(e)
            hint = self._resume_hint()
            raise Stopped(f"stopped by {how} during step {step}; {hint}", code) from None
        except (WorkerDied, RolloutError) as e:  # a process of the run is gone
            raise type(e)(f"step {step}: {e}; {self._resume_hint()}") from None
        finally:
            self.close()
        if self.console is not None:
            self.console.print(f"final model: {self.out / 'final_model'}")
            if "jsonl" in t.loggers:
                self.console.print(f"report: treadle report {self.out}")
        return metrics

    def open_tracker(self) -> Tracker:
        t = self.cfg.trainer
        config = self.cfg.model_dump(mode="json", by_alias=True)
        return Tracker(
            self.out,
            self.total,
            self.start,
            t.progress,
            self.headline,
            loggers=t.loggers,
            config=config,
            console=self.console,
        )

    def samples_due(self, step: int) -> bool:
        """Whether this step's samples go to samples.jsonl and the trackers' tables."""
        every = self.cfg.trainer.log_samples_every
        return bool(every) and (step == self.total or step % every == 0)

    def _resume_hint(self) -> str:
        latest = ckpt.latest_checkpoint(self.out) if self.cfg.trainer.resume else None
        if latest is not None:
            return f"the last checkpoint is {latest}: the same command resumes from it"
        return "there is no checkpoint yet: the same command starts over"

    @functools.cached_property
    def scorer(self) -> Scorer:
        """``reward.function``'s scorer (its worker processes start on first use)."""
        return make_scorer(self.cfg)

    def close(self) -> None:
        try:
            if "scorer" in self.__dict__:
                self.scorer.close()
            if hasattr(self, "rollout"):
                self.rollout.close()
            self.actors.close()
        finally:
            self._restore_logs()
            self.lock.release()
