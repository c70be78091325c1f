"""vLLM rollouts of pictures for the tiny Idefics3 of the shapes task, against transformers.

One vLLM engine per process, and the session's own (tests/engines/conftest.py) serves a text
model: this module's engine runs behind a :class:`RolloutServer` in a Ray actor, so requests
carry their pixel values across a process boundary as a split replica's do. Float32 both sides:
the same greedy tokens, log-probs within 1e-4 (measured ~5e-7; the text tests' tolerance).
"""

from __future__ import annotations

import pytest
import torch

from treadle.data import TextOptions
from treadle.data.images import load_image_processor, read_images
from treadle.data.prompts import prompt_dataset
from treadle.data.readers import read_records
from treadle.engines.inference import HFRolloutEngine, RolloutOutput, SamplingParams
from treadle.models.loading import load_causal_lm, load_tokenizer
from treadle.serving.server import Request

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def replica(ray_session, shapes_task):
    """A Ray actor serving the shapes model with vLLM (float32) behind a RolloutServer."""
    ray = ray_session

    # Defined here so that Ray ships the class by value; the actor imports treadle itself.
    @ray.remote(num_cpus=1)
    class PictureReplica:
        def __init__(self, path: str) -> None:
            from treadle.engines.vllm import VLLMRolloutEngine
            from treadle.serving.server import RolloutServer

            self.engine = VLLMRolloutEngine(path, max_model_len=256, kv_cache_gib=0.25)
            self.server = RolloutServer(self.engine, "picture replica", version=0)

        async def generate(self, requests: list[Request]) -> list:  # type: ignore[type-arg]
            return await self.server.generate(requests)

        def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
            self.server.update_weights(lambda e: e.update_weights(state.items()), version)

        def vllm_processing(self, ids: list[int], images: list) -> tuple:  # type: ignore[type-arg]
            """What vLLM's own processor makes of a prompt with one ``<image>`` per picture
            and the raw pictures: its token ids and pixel values."""
            from vllm import SamplingParams as VLLMSamplingParams
            from vllm.inputs import TokensPrompt

            engine = self.engine.llm.llm_engine
            request = engine.input_processor.process_inputs(
                "vllm-processing",
                TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images}),
                VLLMSamplingParams(max_tokens=1),
                supported_tasks=engine.get_supported_tasks(),
            )
            pixels = [f.data["pixel_values"].data for f in request.mm_features]
            return list(request.prompt_token_ids), torch.cat(pixels)

    actor = PictureReplica.remote(str(shapes_task["model"]))
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def pictures(shapes_task):
    """Test prompts as training sees them (ids, pixel values), the rendered texts with their
    ``<image>`` placeholders, and the raw pictures."""
    path = str(shapes_task["model"])
    tok, processor = load_tokenizer(path), load_image_processor(path)
    assert processor is not None
    records = read_records([shapes_task["test"]], "k")[:4]
    rows = prompt_dataset(records, tok, TextOptions(processor=processor))
    images = [read_images(r, "images") for r in records]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": processor.placeholder + r.row["prompt"]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for r in records
    ]
    return {
        "ids": [rows[i]["prompt_ids"] for i in range(len(rows))],
        "pixels": [rows[i]["pixel_values"] for i in range(len(rows))],
        "texts": texts,
        "images": images,
        "tokenizer": tok,
        "processor": processor,
    }


def serve(ray, replica, prompts, pixels) -> RolloutOutput:  # type: ignore[no-untyped-def]
    requests = [
        Request(f"r{i}", tuple(p), GREEDY, pixel_values=x)
        for i, (p, x) in enumerate(zip(prompts, pixels, strict=True))
    ]
    out = RolloutOutput()
    for r in ray.get(replica.generate.remote(requests)):
        out.token_ids.append(list(r.token_ids))
        out.log_probs.append(list(r.log_probs))
        out.stop_reasons.append(r.stop_reason)
    return out


def transformers(model, tok, prompts, pixels) -> RolloutOutput:  # type: ignore[no-untyped-def]
    engine = HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id)
    return engine.generate(prompts, GREEDY, pixels)


def assert_same_greedy(a: RolloutOutput, b: RolloutOutput) -> None:
    assert a.token_ids == b.token_ids
    assert a.stop_reasons == b.stop_reasons
    for x, y in zip(a.log_probs, b.log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)


def cases(pictures):  # type: ignore[no-untyped-def]
    """Prompts and pictures: the four rows; row 0 with two pictures; row 1's pictures padded
    with an all-zero one (as a batch pads them); row 0's ids with row 2's picture."""
    ids, pixels = list(pictures["ids"]), list(pictures["pixels"])
    two_ids, two = pictures["processor"].encode(
        pictures["texts"][0].replace("<image>", "<image><image>"),
        pictures["images"][0] + pictures["images"][3],
    )
    ids += [two_ids, ids[1], ids[0]]
    pixels += [two, torch.cat([pixels[1], torch.zeros_like(pixels[1])]), pixels[2]]
    return ids, pixels


def test_vllm_takes_training_ids_and_pixels_as_vllms_own_processing_makes_them(
    ray_session, replica, pictures
) -> None:
    """The ids and pixel values treadle's processor made are what vLLM's processor makes of
    the prompt with one ``<image>`` per picture and the raw pictures."""
    tok, processor = pictures["tokenizer"], pictures["processor"]
    for i, (text, images) in enumerate(zip(pictures["texts"], pictures["images"], strict=True)):
        ids, pixels = processor.encode(text, images)
        assert ids == pictures["ids"][i]  # the dataset's prompt
        unexpanded = tok(text, add_special_tokens=False)["input_ids"]
        assert len(unexpanded) < len(ids)
        got_ids, got_pixels = ray_session.get(replica.vllm_processing.remote(unexpanded, images))
        assert got_ids == ids
        torch.testing.assert_close(got_pixels, pixels, atol=1e-6, rtol=0)


def test_greedy_with_pictures_matches_transformers(ray_session, replica, pictures, shapes_task):
    ids, pixels = cases(pictures)
    got = serve(ray_session, replica, ids, pixels)
    model = load_causal_lm(shapes_task["model"])
    assert_same_greedy(got, transformers(model, pictures["tokenizer"], ids, pixels))
    # the picture matters: row 0's prompt with row 2's picture is scored differently
    moved = torch.tensor(got.log_probs[-1][:3]) - torch.tensor(got.log_probs[0][:3])
    assert moved.abs().max() > 1e-3


@torch.no_grad()
def training_greedy(model, ids: list[int], pixels: torch.Tensor, steps: int):  # type: ignore[no-untyped-def]
    """Greedy tokens and their log-probs by the training forward's embedding of the pictures
    (only the prompt's first image tokens are pictures), one full forward a token."""
    from treadle.engines.pictures import picture_embeddings, picture_tokens

    seq, pix, out = torch.tensor([ids]), pixels[None], RolloutOutput()
    tokens, logps = [], []
    for _ in range(steps):
        embeds = picture_embeddings(model, seq, picture_tokens(model, seq, pix), pix)
        logp = torch.log_softmax(model(inputs_embeds=embeds).logits[0, -1].float(), -1)
        tokens.append(int(logp.argmax()))
        logps.append(float(logp.max()))
        seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], 1)
    out.token_ids, out.log_probs, out.stop_reasons = [tokens], [logps], ["length"]
    return out


def test_an_image_token_after_the_pictures_is_an_ordinary_token(
    ray_session, replica, pictures, shapes_task
) -> None:
    """A resumed or multi-turn prompt can hold an image token the policy sampled: vLLM embeds
    it as a plain token, as the training forward does."""
    image = pictures["tokenizer"].convert_tokens_to_ids("<image>")
    ids = [*pictures["ids"][0], 7, image, 9]
    got = serve(ray_session, replica, [ids], [pictures["pixels"][0]])
    model = load_causal_lm(shapes_task["model"])
    want = training_greedy(model, ids, pictures["pixels"][0], GREEDY.max_new_tokens)
    assert_same_greedy(got, want)


def test_weight_update_reaches_the_vision_tower(ray_session, replica, pictures, shapes_task):
    """New vision tower and connector weights (the decoder's unchanged): vLLM's rollouts are
    then those of the new model, none computed from the old pictures' features."""
    ids, pixels = pictures["ids"], pictures["pixels"]
    before = serve(ray_session, replica, ids, pixels)  # the old features enter the caches
    model = load_causal_lm(shapes_task["model"])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("model.vision_model.", "model.connector.")):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    ray_session.get(replica.update_weights.remote(model.state_dict(), 1))
    after = serve(ray_session, replica, ids, pixels)
    assert_same_greedy(after, transformers(model, pictures["tokenizer"], ids, pixels))
    first = [abs(x[0] - y[0]) for x, y in zip(after.log_probs, before.log_probs, strict=True)]
    assert max(first) > 1e-2  # the new features are used, not cached old ones


def test_pictures_and_their_image_tokens_must_agree() -> None:
    from types import SimpleNamespace

    from treadle.engines.vllm.pictures import PictureLayout, _placeholders

    vision = SimpleNamespace(image_size=64, patch_size=8)
    config = SimpleNamespace(vision_config=vision, image_token_id=5, scale_factor=2)
    layout = PictureLayout.of(config)
    assert layout == PictureLayout(image_token_id=5, image_seq_len=16)
    ids = [1, *[5] * 16, 2, *[5] * 16, 5, 3]  # two pictures, then an image token of a response
    assert _placeholders(ids, 2, layout) == [(1, 16), (18, 16)]
    with pytest.raises(ValueError, match=r"3 pictures need 48 image tokens .* the prompt has 33"):
        _placeholders(ids, 3, layout)
    with pytest.raises(ValueError, match="the image tokens of picture 0 are not one run of 16"):
        _placeholders([5, 1, *[5] * 15], 1, layout)
    with pytest.raises(ValueError, match=r"Idefics3-family .* use rollout\.engine=hf"):
        PictureLayout.of(SimpleNamespace(vision_config=vision, architectures=["Qwen2VL"]))
