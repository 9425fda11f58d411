"""A chat-format tool environment on the torch and MLX engines: the tiny model,
taught two episodes of `chattools` (a call, the tool's reply, the price),
runs them greedily to the same tokens on both, and the trainer's replay
accepts them and refuses an altered tool message."""

import copy
from dataclasses import replace

import pytest
import torch

from chat_templates import QWEN
from colonnade.engine import SamplingParams, engine_for
from colonnade.envs import load_environment
from colonnade.model import int8_state, load_model, resolve_model
from colonnade.protocol import EpisodeRecord
from colonnade.protocol.turns import chat_reply, episode_stops, task_prompt
from colonnade.rollout.episodes import run_episodes
from colonnade.train.samples import Rejected, rebuild_episode

PARAMS = SamplingParams(temperature=0, max_turn_tokens=64, max_episode_tokens=256)


# The fixture teaches the tiny model two episodes first: minutes on 2 cores.
pytestmark = pytest.mark.slow


def _call(item: str) -> str:
    return f'<tool_call>{{"name": "price", "arguments": {{"item": "{item}"}}}}</tool_call>'


def _taught(model, tok, env, tasks, steps=100):
    """The model, fitted to each task's whole episode (teacher forcing on
    what the model writes) for `steps` passes, so that its greedy episodes
    call the tool: a random model never does."""
    seqs = []
    for t in tasks:
        call = _call(t.info["item"])
        prompt = task_prompt(tok, env, t)
        ids = list(prompt)
        for text in (call, chat_reply(tok, env, t, [call]), t.answers[0]):
            ids += tok.encode(text, add_special_tokens=False)
        labels = torch.tensor([[-100] * len(prompt) + ids[len(prompt) :] + [tok.eos_token_id]])
        seqs.append((torch.tensor([[*ids, tok.eos_token_id]]), labels))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    model.train()
    for _ in range(steps):
        total = 0.0
        for x, labels in seqs:
            loss = model(input_ids=x, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        if total < 0.002:
            break
    return model.eval()


def _greedy_is_taught(engine, env, tasks) -> bool:
    """Whether the int8 engine's greedy episodes are the taught ones: the
    loss alone does not say so, since float rounding differs by machine."""
    results = run_episodes(engine, env, tasks, PARAMS)
    return all(
        r.episode.turns[:1] == [_call(t.info["item"])] and r.score.reward == 1.0
        for r, t in zip(results, tasks, strict=True)
    )


@pytest.fixture(scope="module")
def setup(mlx_ready, tmp_path_factory):
    env = load_environment("chattools", n_tasks=10)
    folder = resolve_model("tiny", env.tokenizer_texts(), cache=tmp_path_factory.mktemp("chat"))
    model, tok = load_model(folder)
    tok = copy.deepcopy(tok)
    tok.chat_template = QWEN  # a template that takes tools= and writes tool messages
    tasks = list(env.tasks("train"))[:2]
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    for _ in range(4):  # teach until the quantized greedy episodes are right
        model = _taught(model, tok, env, tasks)
        state = int8_state(model)
        check = engine_for(copy.deepcopy(model), tok, state, "int8", cpu, "torch")
        if _greedy_is_taught(check, env, tasks):
            break
    engines = [engine_for(model, tok, state, "int8", cpu, b, version=3) for b in ("torch", "mlx")]
    return env, tasks, engines


def test_greedy_chat_tool_episodes_are_the_same_on_torch_and_mlx(setup):
    env, tasks, (torch_engine, mlx) = setup
    a = run_episodes(torch_engine, env, tasks, PARAMS)
    b = run_episodes(mlx, env, tasks, PARAMS)
    for x, y, task in zip(a, b, tasks, strict=True):
        assert x.episode.tokens == y.episode.tokens and x.episode.turns == y.episode.turns
        assert x.episode.from_model == y.episode.from_model
        # The model called the tool in its own format and answered from the reply.
        assert x.episode.turns[0] == _call(task.info["item"])
        assert not all(x.episode.from_model)  # a tool message between the turns
        assert x.score.metrics == {"correct": 1.0, "called": 1.0}


def test_the_replay_accepts_honest_chat_episodes_and_refuses_an_altered_tool_message(setup):
    env, tasks, (torch_engine, _) = setup
    tok = torch_engine.tokenizer
    stop = episode_stops((), env)
    for r in run_episodes(torch_engine, env, tasks, PARAMS):
        ep = r.episode
        record = EpisodeRecord(ep.tokens, ep.from_model, ep.logprobs, ep.finish, ep.below)
        sample = rebuild_episode(tok, env, r.task.id, record, 3, stop, 4096)
        assert sample.score.reward == 1.0
        assert sample.ids == ep.prompt_ids + ep.tokens
        # The tool message says another price, in as many tokens.
        first = ep.from_model.index(False)
        price = tok.encode(r.task.answers[0], add_special_tokens=False)
        at = next(i for i in range(first, len(ep.tokens)) if ep.tokens[i : i + len(price)] == price)
        other = tok.encode("1", add_special_tokens=False)
        forged = [*ep.tokens[:at], *other, *ep.tokens[at + len(price) :]]
        model = [*ep.from_model[:at], *[False] * len(other), *ep.from_model[at + len(price) :]]
        probs = [0.0] * len(forged)
        bad = EpisodeRecord(forged, model, probs, ep.finish, probs)
        with pytest.raises(Rejected, match="tool reply after turn 1 differs"):
            rebuild_episode(tok, env, r.task.id, bad, 3, stop, 4096)


def test_a_tool_reply_past_the_episode_budget_ends_it_as_an_overflow(setup):
    env, tasks, (torch_engine, mlx) = setup
    first_turn = len(torch_engine.tokenizer.encode(_call(tasks[0].info["item"])))
    tight = replace(PARAMS, max_episode_tokens=first_turn + 4)
    for engine in (torch_engine, mlx):
        (r,) = run_episodes(engine, env, tasks[:1], tight)
        assert r.episode.finish == "overflow" and all(r.episode.from_model)
        assert r.episode.turns == [_call(tasks[0].info["item"])]
