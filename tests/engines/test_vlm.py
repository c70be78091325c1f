"""A vision-language model in the engines: log-probs with pictures (padded and packed equal
the model's own forward, and the pictures matter), and weight sync that carries the vision
tower to the transformers rollout engine."""

from __future__ import annotations

import torch

from treadle.controller import Collect, Dispatch, Worker, WorkerGroup, register
from treadle.data import TextOptions, prompt_batch
from treadle.data.images import PIXELS, load_image_processor
from treadle.data.prompts import prompt_dataset
from treadle.data.readers import read_records
from treadle.engines.fsdp import TrainEngine
from treadle.engines.inference import HFRolloutEngine, SamplingParams
from treadle.engines.packing import pack
from treadle.engines.weights import weight_buckets
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.protocol import Batch


def image_batch(task, n: int = 4, response: int = 3) -> Batch:  # type: ignore[no-untyped-def]
    """``n`` test prompts with their pictures, each followed by ``response`` random tokens
    (right-padded unevenly): input_ids, attention_mask, rmask, pixel_values."""
    tok = load_tokenizer(task["model"])
    options = TextOptions(processor=load_image_processor(str(task["model"])))
    ds = prompt_dataset(read_records([task["test"]], "k")[:n], tok, options)
    prompts = prompt_batch(ds, list(range(n)), ds.pad_id)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(3, 200, (n, response), generator=g)
    rmask = torch.ones(n, response, dtype=torch.long)
    rmask[1, 2:] = 0
    return Batch.from_dict(
        tensors={
            "input_ids": torch.cat([prompts["prompts"], responses], 1),
            "attention_mask": torch.cat([prompts["prompt_mask"], rmask], 1),
            "rmask": rmask,
            PIXELS: prompts[PIXELS],
        }
    )


class EngineWorker(Worker):
    def __init__(self, rank, world_size, addr, port, *, model_path: str, row_tokens=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(rank, world_size, addr, port)
        self.engine = TrainEngine(load_causal_lm(model_path), chunk_size=4, row_tokens=row_tokens)

    @register(Dispatch.ALL, Collect.RANK0)
    def log_probs(self, batch: Batch, pictures: bool = True) -> torch.Tensor:
        with torch.no_grad():
            logp, _ = self.engine.log_probs(
                batch["input_ids"],
                batch["attention_mask"],
                batch["rmask"].shape[1],
                pixel_values=batch[PIXELS] if pictures else None,
            )
        return logp

    @register(Dispatch.ALL, Collect.RANK0)
    def full_state(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.engine.full_state()}


def engine_log_probs(
    path: str, batch: Batch, row_tokens: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    group = WorkerGroup(
        EngineWorker,
        world_size=1,
        backend="local",
        kwargs={"model_path": path, "row_tokens": row_tokens},
    )
    try:
        return group.log_probs(batch), group.log_probs(batch, pictures=False)
    finally:
        group.shutdown()


def test_log_probs_with_pictures_equal_the_models_forward_padded_and_packed(shapes_task) -> None:
    path = str(shapes_task["model"])
    batch = image_batch(shapes_task)
    r = batch["rmask"].shape[1]
    model = load_causal_lm(path)
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            pixel_values=batch[PIXELS],
        ).logits.float()
    want = torch.log_softmax(logits[:, -r - 1 : -1], -1).gather(
        -1, batch["input_ids"][:, -r:, None]
    )[..., 0]
    valid = batch["rmask"].bool()
    for row_tokens in (None, 64):  # 64: two sequences of ~30 tokens a packed row
        got, without = engine_log_probs(path, batch, row_tokens)
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
        assert (got[valid] - without[valid]).abs().max() > 1e-3  # the pictures matter


def test_packed_pictures_follow_their_image_tokens() -> None:
    ids = torch.tensor([[0, 5, 9, 1], [5, 9, 1, 2], [0, 0, 5, 3]])
    mask = (torch.arange(4) >= torch.tensor([[1], [0], [2]])).long()
    layout = pack(ids, mask, torch.ones(3, 1, dtype=torch.bool), row_tokens=8)
    # rows filled longest first: sample 1 (4 tokens), then 0 (3), then 2 (2 -> a new row)
    assert layout.order.tolist() == [1, 0, 2]
    pixels = torch.arange(3.0).view(3, 1, 1, 1, 1).expand(3, 2, 1, 1, 1)
    packed = layout.packed_pixels(pixels)
    assert packed.shape == (1, 6, 1, 1, 1)
    assert packed.flatten().tolist() == [1, 1, 0, 0, 2, 2]


def test_weight_sync_carries_the_vision_tower_to_the_rollout_engine(shapes_task, tmp_path) -> None:
    path = str(shapes_task["model"])
    group = WorkerGroup(EngineWorker, world_size=1, backend="local", kwargs={"model_path": path})
    try:
        state = group.full_state()
    finally:
        group.shutdown()
    names = set(state)
    assert any(n.startswith("model.vision_model.encoder.layers.") for n in names)
    assert {
        "model.connector.modality_projection.proj.weight",
        "model.text_model.embed_tokens.weight",
    } <= names
    tok = load_tokenizer(path)
    engine = HFRolloutEngine(load_causal_lm(path), [tok.eos_token_id], tok.pad_token_id)
    assert set(engine.params) <= names | {"lm_head.weight"}
    # new weights: every tensor changed, vision tower included; the engine takes them all
    g = torch.Generator().manual_seed(1)
    changed = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in state.items()}
    changed["lm_head.weight"] = changed["model.text_model.embed_tokens.weight"]  # tied
    buckets = list(weight_buckets(changed.items(), bucket_bytes=64 * 1024))  # as replicas get it
    assert len(buckets) > 3
    engine.load_payloads(buckets)
    for name, param in engine.params.items():
        torch.testing.assert_close(param.detach(), changed[name])
    batch = image_batch(shapes_task, n=2)
    ids, mask = batch["input_ids"][:, :-3], batch["attention_mask"][:, :-3]
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    greedy = SamplingParams(temperature=0, max_new_tokens=4)
    pictures = [batch[PIXELS][0], batch[PIXELS][1]]
    out = engine.generate(prompts, greedy, pictures)
    reference = load_causal_lm(path)
    reference.load_state_dict(changed, strict=False)
    with torch.no_grad():
        seq = reference.generate(
            input_ids=torch.tensor([prompts[0]]),
            pixel_values=batch[PIXELS][:1],
            do_sample=False,
            max_new_tokens=4,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id,
        )
    assert out.token_ids[0] == seq[0, len(prompts[0]) :].tolist()[: len(out.token_ids[0])]


def test_an_image_token_in_a_response_is_an_ordinary_token_as_in_generation(shapes_task) -> None:
    """A policy may sample the image token; generation embedded it as a plain token (pictures
    go in at prefill only), and so does the update's forward, padded and packed."""
    path = str(shapes_task["model"])
    batch = image_batch(shapes_task, n=2)
    image_id = load_tokenizer(path).convert_tokens_to_ids("<image>")
    batch["input_ids"][:, -2] = image_id  # both responses hold it (row 1: as its last token)
    r = batch["rmask"].shape[1]
    model = load_causal_lm(path)
    want = torch.zeros(2, r)
    with torch.no_grad():
        for i in range(2):  # prefill with the picture, then the response through the cache
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()]
            prompt, response = ids[: -r if i == 0 else -r + 1], ids[-r if i == 0 else -r + 1 :]
            first = model(input_ids=prompt[None], pixel_values=batch[PIXELS][i : i + 1])
            rest = model(input_ids=response[None], past_key_values=first.past_key_values)
            logits = torch.cat([first.logits[:, -1:], rest.logits[:, :-1]], 1)[0].float()
            logp = torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]
            want[i, : len(logp)] = logp
    valid = batch["rmask"].bool()
    for row_tokens in (None, 64):
        got, _ = engine_log_probs(path, batch, row_tokens)
        torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
