"""Episodes of an environment that runs its own loop over an OpenAI API (`vf:NAME`).

The environment (`envs/verifiers.py`) calls a model through an
`openai.AsyncOpenAI` client; here that client points at an endpoint in this
process over the worker's engine (`colonnade.serve`), so its requests join
one running batch as rows free up, as a list of episodes would.

Phases, in order:
1. one `Episodes` entry per episode, with its draw key (`protocol.draws`);
2. the endpoint starts; the environment's loops run on an event loop of
   their own thread, every episode at once, each request carrying its
   episode's handle (`colonnade_episode` in `extra_body`);
3. the engine runs on this thread (MLX keeps its streams per thread: this
   is the thread that built the engine) until the loops are done;
4. each episode's stitched stream becomes an `Episode`, its rubric's score
   beside it; an episode whose turns are not one stream, or whose first
   request was not on the task's prompt (which the trainer rebuilds), is
   refused here, saying why (the worker sends no batch with it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from colonnade.engine import Engine, Episode
from colonnade.engine.loop import seeded_keys
from colonnade.envs import Score, Task
from colonnade.protocol.turns import SamplingParams, chat_prompt
from colonnade.serve import Bounds, Served, Server
from colonnade.serve.episodes import Episodes, Stitched
from colonnade.serve.requests import EPISODE_FIELD, SPENT

REQUEST_SECONDS = 600.0  # one model turn, its wait for a row included
MAX_PROMPT_TOKENS = 1 << 20  # the episode budget bounds what a turn may add


class BrokenEpisode(RuntimeError):
    """An episode whose turns do not make one token stream."""


def run_through_endpoint(
    env,
    engine: Engine,
    tasks: Sequence[Task],
    params: SamplingParams,
    seed: int = 0,
    max_rows: int = 0,
    keys: Sequence[bytes] | None = None,
) -> list:
    """One episode per task (a group's copies side by side), as
    `rollout.episodes.run_episodes` returns them: `Result`s, scored by the
    environment's rubric on this side."""
    from .episodes import Result

    keys = list(keys) if keys is not None else seeded_keys(seed, len(tasks))
    if len(keys) != len(tasks):
        raise ValueError("one draw key per episode")
    episodes = Episodes(engine.tokenizer)
    handles = [episodes.open(k, params.max_episode_tokens) for k in keys]
    bounds = Bounds(max_tokens=params.max_turn_tokens, max_prompt_tokens=MAX_PROMPT_TOKENS,
                    max_n=1, max_episodes=1, max_messages=4 * env.max_turns + 8)  # fmt: skip
    served = Served(env.name, params, bounds, episodes)
    server = Server(engine, served, max_rows=max_rows or len(tasks), port=0,
                    request_timeout=REQUEST_SECONDS)  # fmt: skip
    played: list = [None] * len(tasks)
    failed: list[BaseException] = []

    def loops() -> None:
        try:
            asyncio.run(_play(env, server.url, tasks, handles, episodes, params, played))
        except BaseException as e:  # handed to the engine's thread, raised there
            failed.append(e)
        finally:
            server.batcher.close()

    thread = threading.Thread(target=loops, name="env-loops", daemon=True)
    server.endpoint.start()
    thread.start()
    try:
        server.batcher.serve()
    finally:
        thread.join()
        server.endpoint.close()
    if failed:
        raise failed[0]
    out = []
    for task, handle, (_, _, score) in zip(tasks, handles, played, strict=True):
        stitched = episodes.close(handle)
        why = _broken(stitched, chat_prompt(engine.tokenizer, env.prompt(task)))
        if why is not None:
            raise BrokenEpisode(f"{env.name}, task {task.id}: {why}")
        out.append(Result(task, as_episode(stitched, engine, params), score))
    return out


def _broken(stitched: Stitched, prompt: list[int]) -> str | None:
    """Why the episode cannot be sent, or None. The trainer rebuilds its
    prompt from the task: a first request on other messages (an environment
    that adds to the row's prompt) would be trained on the wrong prefix."""
    if not stitched.turns:
        return "the environment asked the model nothing"
    if stitched.broken is not None:
        return stitched.broken
    if stitched.prompt != prompt:
        return "its first request is not on the task's prompt (the row's messages as given)"
    return None


async def _play(env, url: str, tasks, handles, episodes: Episodes, params: SamplingParams,
                played: list) -> None:  # fmt: skip
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="in-process", max_retries=0,
                                timeout=REQUEST_SECONDS)  # fmt: skip
    try:

        async def one(i: int) -> None:
            extra = {EPISODE_FIELD: handles[i]}
            try:
                played[i] = await env.play(client, tasks[i], extra, params.max_turn_tokens)
            except openai.BadRequestError as e:
                if SPENT not in str(e):
                    raise
                # The loop asked for a turn past the run's episode tokens: the
                # episode ends where they ran out, unanswered, and scores 0.
                episodes.get(handles[i]).finish = "length"
                played[i] = (None, None, Score(0.0, {}))

        await asyncio.gather(*(one(i) for i in range(len(tasks))))
    finally:
        await client.close()


def as_episode(stitched: Stitched, engine: Engine, params: SamplingParams) -> Episode:
    """The stitched stream as the engine records an episode: the environment
    ended it ("done") unless its last turn ran out of tokens ("length")."""
    ep = Episode(list(stitched.prompt), engine.version)
    ep.tokens, ep.from_model = list(stitched.tokens), list(stitched.from_model)
    ep.logprobs, ep.below = list(stitched.logprobs), list(stitched.below)
    ep.finish = "length" if stitched.finish == "length" else "done"
    turn: list[int] = []
    for tok, mine in zip([*ep.tokens, None], [*ep.from_model, False], strict=True):
        if mine:
            turn.append(tok)
        elif turn:
            ep.turns.append(engine.tokenizer.decode(turn, skip_special_tokens=True))
            turn = []
    return ep
