"""The frozen teacher of ``treadle distill``: replicas that score the student's samples and
generate.

:func:`start_teacher` starts the teacher's replicas as the ``teacher`` section says and returns
a :class:`Teacher`:

- ``Teacher.score(batch, top_k)``: for every sample of an RL batch (left-padded ``prompts``,
  right-padded ``responses``), one :class:`~treadle.serving.server.ScoreRequest` of the
  sequence prompt + response, scored from the first response token on; the requests fan out
  over the replicas at once (:meth:`~treadle.serving.client.RolloutClient.score_many`, least
  outstanding). The response is the tokens up to the last one attended
  (``response_attention_mask`` when the batch has one, else ``response_mask``), so a
  multi-turn sample's tool tokens (mask 0) are scored as context of the tokens after them.
  It returns a batch of

  ========================  ============  ==============================================
  teacher_log_probs         [B, R] f32    log p_teacher(token | everything before it),
                                          temperature 1; 0 where response_mask is 0 or
                                          beyond the response
  teacher_topk_ids          [B, R, K] i64 the teacher's K most likely ids at each
                                          position, most likely first (top_k > 0 only)
  teacher_topk_log_probs    [B, R, K] f32 their log-probs (top_k > 0 only)
  ========================  ============  ==============================================

  Where ``response_mask`` is 0 or beyond the response, the top-k rows are ids 0 and
  log-probs 0: a loss must mask them with ``response_mask`` (a log-prob of 0 is not a
  probability of 0).
- ``Teacher.rollout``: the same replicas as a :class:`~treadle.rollout.fleet.Rollout`, so
  ``teacher.rollout.generate(prompts, params)`` samples from the teacher (sequence-level KD)
  with the run's agent loop (single-turn when the loop talks through the OpenAI-compatible
  endpoint, which is the student's). Its weights never change: version 0 throughout.

Placement (``teacher.placement``) is a frozen model's (:mod:`treadle.rollout.frozen`):
``split``, ``teacher.replicas`` Ray actors in a pool of their own (Ray only, restarted when
they die, named "teacher replica i"); ``colocated``, a transformers engine in every actor
rank's process (:class:`~treadle.serving.replica.ServesTeacher`, made by ``init_teacher``).

Checked at start: ``teacher.model_path`` is a model folder, and its vocabulary is the
student's (config.json ``vocab_size``, and the tokenizer when the folder has one): the teacher
scores the student's token ids.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from treadle.agents.loops import single_turn
from treadle.agents.registry import needs_endpoint
from treadle.agents.tools import Toolbox
from treadle.config import Config
from treadle.controller import ResourcePool, WorkerGroup
from treadle.models.loading import (
    TOKENIZER_FILES,
    load_tokenizer,
    resolve_model_path,
    shared_vocabulary,
)
from treadle.protocol import Batch, response_attention
from treadle.rollout.fleet import Agents, Rollout
from treadle.rollout.frozen import frozen_cpus, reserve_frozen_pool, serve_frozen
from treadle.runtime.errors import ConfigError
from treadle.serving.client import RolloutClient
from treadle.serving.server import ScoreRequest, ScoreResponse

logger = logging.getLogger("treadle")

KEY = "teacher.model_path"


class Teacher:
    """The teacher's replicas: :meth:`score` a batch, ``rollout.generate`` from prompts."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout

    @property
    def client(self) -> RolloutClient:
        return self.rollout.client

    def score(self, batch: Batch, top_k: int) -> Batch:
        """``teacher_log_probs`` (and, with ``top_k > 0``, ``teacher_topk_ids`` and
        ``teacher_topk_log_probs``) of the batch's responses; see the module docstring."""
        requests, rows = score_requests(batch, top_k, self.client.new_id)
        responses = self.client.score(requests) if requests else []
        return teacher_fields(batch, rows, responses, top_k)

    def close(self) -> None:
        """Stop the client; split: kill the replicas and give their pool back."""
        self.rollout.close()


def score_requests(batch: Batch, top_k: int, new_id: Any) -> tuple[list[ScoreRequest], list[int]]:
    """One request per sample with a response (prompt + response tokens, scored from the
    response on) and the rows they are for; ``new_id(prefix)`` names them."""
    prompts, prompt_mask = batch["prompts"], batch["prompt_mask"].bool()
    lengths = response_lengths(batch)
    requests, rows = [], []
    for i, length in enumerate(lengths.tolist()):
        if length == 0:
            continue
        prompt = prompts[i][prompt_mask[i]].tolist()
        if not prompt:
            raise ValueError(f"teacher score: sample {i} has an empty prompt")
        tokens = tuple(prompt + batch["responses"][i, :length].tolist())
        requests.append(ScoreRequest(new_id("t"), tokens, len(prompt), top_k))
        rows.append(i)
    return requests, rows


def response_lengths(batch: Batch) -> torch.Tensor:
    """Per sample, the response tokens up to the last one attended [B] (0: none)."""
    attended = response_attention(batch).bool()
    columns = torch.arange(1, attended.shape[1] + 1)
    return (attended * columns).amax(dim=1) if attended.shape[1] else attended.sum(1)


def teacher_fields(
    batch: Batch, rows: list[int], responses: list[ScoreResponse], top_k: int
) -> Batch:
    """The teacher's columns of ``batch`` from the responses for ``rows`` (module docstring)."""
    b, width = batch["responses"].shape
    log_probs = torch.zeros(b, width, dtype=torch.float32)
    ids = torch.zeros(b, width, top_k, dtype=torch.long)
    top = torch.zeros(b, width, top_k, dtype=torch.float32)
    for i, r in zip(rows, responses, strict=True):
        n = len(r.log_probs)
        log_probs[i, :n] = torch.tensor(r.log_probs, dtype=torch.float32)
        if top_k:
            ids[i, :n] = torch.tensor(r.topk_ids, dtype=torch.long).view(n, top_k)
            top[i, :n] = torch.tensor(r.topk_log_probs, dtype=torch.float32).view(n, top_k)
    counts = batch["response_mask"].bool()
    tensors = {"teacher_log_probs": log_probs.masked_fill(~counts, 0.0)}
    if top_k:
        tensors["teacher_topk_ids"] = ids.masked_fill(~counts[..., None], 0)
        tensors["teacher_topk_log_probs"] = top.masked_fill(~counts[..., None], 0.0)
    return Batch.from_dict(tensors=tensors)


# ----------------------------------------------------------------------------- start-up


def teacher_cpus(cfg: Config) -> float:
    """CPUs of the split teacher pool (0 when colocated)."""
    return frozen_cpus(cfg.teacher)


def check_teacher(cfg: Config, tokenizer: Any) -> str:
    """``teacher.model_path`` resolved, after checking it is a model folder whose vocabulary is
    the student's (config.json sizes; the tokenizers, when the teacher's folder has one)."""
    t, m = cfg.teacher, cfg.model
    if t.model_path is None:
        raise ConfigError(f"{KEY} is not set: treadle distill needs the teacher's model folder")
    if cfg.trainer.backend == "local" and t.placement == "split":
        raise ConfigError(
            "trainer.backend=local runs one rank in-process; set teacher.placement=colocated "
            "or use trainer.backend=ray"
        )
    if t.placement == "colocated" and t.engine != "hf":
        raise ConfigError(
            f"teacher.engine={t.engine} needs teacher.placement=split (one vLLM engine per "
            "process: the rollout's); or set teacher.engine=hf"
        )
    path = resolve_model_path(t.model_path, key=KEY, allow_download=m.allow_download)
    shared_vocabulary(m.path, [(KEY, t.model_path)], m.allow_download)
    folder = Path(path)
    if folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES):
        theirs = load_tokenizer(path, key=KEY, allow_download=m.allow_download)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"{KEY}: the tokenizer of '{t.model_path}' ({len(theirs)} tokens) is not the "
                f"student's ({len(tokenizer)} tokens, model.tokenizer_path or model.path); the "
                "teacher scores the student's token ids, so both must tokenize alike"
            )
    return path


def reserve_teacher_pool(cfg: Config) -> ResourcePool | None:
    """The split teacher's placement group (None when colocated)."""
    return reserve_frozen_pool(cfg, cfg.teacher)


def start_teacher(
    cfg: Config, group: WorkerGroup, tokenizer: Any, pool: ResourcePool | None = None
) -> Teacher:
    """The teacher's replicas as ``teacher.placement`` says (see the module docstring), the
    student's ``tokenizer`` checked against the teacher's. Colocated: on ``group`` (the
    actor's workers); split: in ``pool`` (:func:`reserve_teacher_pool`; reserved here if not
    given). Its rollout generates with the run's agent loop (single-turn when the loop talks
    through the OpenAI-compatible endpoint, which is the student's)."""
    path = check_teacher(cfg, tokenizer)
    if needs_endpoint(cfg.rollout.agent_loop):
        agents = Agents(single_turn, Toolbox([]), tokenizer)
    else:
        agents = Agents.from_config(cfg, tokenizer)
    return Teacher(serve_frozen(cfg, group, "teacher", cfg.teacher, path, agents, pool))
