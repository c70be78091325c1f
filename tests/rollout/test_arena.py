"""TextArena games as black-box agents (treadle.agents.arena), unchanged, through the real
`openai` client: here against a stub chat-completions server that plays scripted moves."""

from __future__ import annotations

import asyncio
import random

import openai
from aiohttp import web

from treadle.agents.arena import play


class Stub:
    """A chat-completions server answering each request with the next scripted move."""

    def __init__(self, moves: list[str]) -> None:
        self.moves, self.requests = list(moves), []

    async def chat(self, request):
        body = await request.json()
        self.requests.append(body)
        content = self.moves.pop(0)
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )


def run(moves: list[str], row: dict) -> tuple[dict, list[dict]]:
    """``play(client, row)`` with an AsyncOpenAI client on a stub server; (result, requests)."""
    stub = Stub(moves)

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", stub.chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            url = f"http://127.0.0.1:{port}/v1"
            async with openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0) as client:
                return await play(client, row)
        finally:
            await runner.cleanup()

    return asyncio.run(main()), stub.requests


def target(seed: int, high: int = 20) -> int:
    """The number GuessTheNumber deals for ``seed`` (it seeds the global generator)."""
    return random.Random(seed).randint(1, high)


def test_a_raw_game_is_one_growing_chat_and_its_reward_is_the_games():
    n = target(7)
    guesses = [f"[{n + 1}]" if n < 20 else "[1]", f"I say [{n}]"]
    result, requests = run(guesses, {"env_id": "GuessTheNumber-v0-raw", "seed": 7})
    assert result == {"reward": 1.0, "moves": 2, "invalid_move": 0.0, "finished": 1.0}
    first, second = (r["messages"] for r in requests)
    assert first[0]["role"] == "system" and "competitive game player" in first[0]["content"]
    assert first[1]["role"] == "user" and "playing Guess The Number" in first[1]["content"]
    hint = "lower" if n < 20 else "higher"
    # the second call extends the first: the move as the assistant, the game's answer as user
    assert second == [
        *first,
        {"role": "assistant", "content": guesses[0]},
        {"role": "user", "content": f"The target number is {hint}."},
    ]
    assert {r["model"] for r in requests} == {"policy"}


def test_a_rendered_view_is_asked_afresh_each_move_and_rules_are_the_games():
    n = target(3)
    wrong = 1 if n != 1 else 2
    result, requests = run([f"[{wrong}]"] * 3, {"env_id": "GuessTheNumber-v0", "seed": 3})
    # a repeated guess is an invalid move; the game forgives one, ends on the second with its
    # own partial reward
    assert result["invalid_move"] == 1.0 and result["finished"] == 1.0 and result["moves"] == 3
    assert 0.0 <= result["reward"] < 1.0
    assert [len(r["messages"]) for r in requests] == [2, 2, 2]  # system + the whole view
    assert "attempted an invalid move" in requests[2]["messages"][1]["content"]
    assert requests[1]["messages"][1]["content"] in requests[2]["messages"][1]["content"]


def test_the_deal_follows_the_row_and_our_random_state_is_left_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    row = {"env_id": "GuessTheNumber-v0-raw", "prompt": "p", "answer": "a"}  # no seed column
    _, one = run(["[50]"] * 2, row)  # out of range: invalid twice, the game ends
    _, two = run(["[50]"] * 2, dict(row))
    assert random.random() == expected
    assert one[0]["messages"] == two[0]["messages"]


def test_moves_are_bounded_by_the_row():
    moves = [f"[{i}]" for i in range(1, 21)]
    n = target(5)
    moves.remove(f"[{n}]")  # never the number
    result, requests = run(moves, {"env_id": "GuessTheNumber-v0-raw", "seed": 5, "max_turns": 3})
    assert result == {"reward": 0.0, "moves": 3, "invalid_move": 0.0, "finished": 0.0}
    assert len(requests) == 3
