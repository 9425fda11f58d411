"""The endpoint's throughput against the engine called directly.

`colonnade bench serve` runs the same single-turn chat episodes (searchqa's
test prompts in the model's chat template) twice on one engine, side by
side in one run:

- directly: `Engine.generate` over all of them, at most `--clients` rows at
  once (continuous batching);
- through the endpoint (`colonnade.serve`, on this machine): `--clients`
  concurrent clients of the standard `openai` package, in a process of
  their own, each sending one chat request at a time.

Episode i is drawn by the same key on both paths (the request's seed is i:
`serve.requests.Job.keys`), so both sample the same episodes but where a
row's neighbours in the batch move a log-prob across a draw's boundary
(int8); `same_episodes` is the share whose tokens are identical. Each path
is warmed up first; then `--repeats` rounds, each timing the direct path
and then the endpoint, so that a machine shared with other work slows both
alike: the median episodes/s of each (`direct_episodes_s`,
`endpoint_episodes_s`), the median of the rounds' ratios
(`endpoint_over_direct`), and every round's pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

MODELS = ("tiny", "smollm2-135m")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default="tiny", help=f"comma list of {', '.join(MODELS)} (default: tiny)"
    )
    p.add_argument("--episodes", type=int, default=128, help="episodes a path (default 128)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients and engine rows")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens an episode (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of both paths (median)")
    p.add_argument("--engine", default="torch", choices=("torch", "mlx"), help="rollout engine")
    p.add_argument("--precision", default="int8", choices=("int8", "bf16", "fp32"))
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")


def log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        raise SystemExit(f"error: --models must be among {', '.join(MODELS)}")
    if min(args.episodes, args.clients, args.tokens, args.repeats) < 1:
        raise SystemExit("error: --episodes, --clients, --tokens and --repeats must be >= 1")
    try:
        import openai  # noqa: F401  (the clients' process imports it too)
    except ImportError:
        raise SystemExit("error: the bench needs the openai package (pip install openai)") from None
    rows = [_model_row(name, args) for name in models]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
    return 0


def _model_row(name: str, args: argparse.Namespace) -> dict:
    import torch

    from colonnade.engine import load_engine
    from colonnade.envs import load_environment
    from colonnade.model import resolve_model
    from colonnade.model.kernels import cpu_model

    env = load_environment("searchqa")
    log(f"loading {name} ({args.engine} {args.precision})")
    path = resolve_model(name, env.tokenizer_texts if name == "tiny" else None)
    engine = load_engine(path, args.precision, "cpu", engine=args.engine)
    tasks = list(env.tasks("test"))
    chats = [env.prompt(tasks[i % len(tasks)]) for i in range(args.episodes)]
    rounds, direct, endpoint = _rounds(engine, name, chats, args)
    same = sum(a == b for a, b in zip(direct, endpoint, strict=True)) / len(chats)
    d, e = (statistics.median(r[k] for r in rounds) for k in (0, 1))
    ratio = statistics.median(e / d for d, e in rounds)  # each round's paths close in time
    return {
        "model": name,
        "engine": engine.name,
        "precision": args.precision,
        "episodes": len(chats),
        "clients": args.clients,
        "max_tokens": args.tokens,
        "tokens_per_episode": round(sum(map(len, direct)) / len(direct), 1),
        "direct_episodes_s": round(d, 2),
        "endpoint_episodes_s": round(e, 2),
        "endpoint_over_direct": round(ratio, 3),
        "rounds": [[round(x, 2) for x in r] for r in rounds],
        "same_episodes": round(same, 3),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
    }


def _rounds(engine, name: str, chats: list, args: argparse.Namespace):
    """([(direct episodes/s, endpoint episodes/s)] a round, the last round's
    token ids of each path). The server's engine thread waits for requests
    while the direct path runs on the same engine: never both at once."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from colonnade.engine import SamplingParams
    from colonnade.serve import Bounds, Served, Server

    served = Served(name, SamplingParams(), Bounds(max_tokens=args.tokens))
    rounds = []
    with Server(engine, served, max_rows=args.clients, port=0) as server:
        log(f"endpoint at {server.url}: {args.clients} openai clients in their own process")
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:

            def through_endpoint(some: list):
                job = pool.submit(clients_run, server.url, name, some, args.clients, args.tokens)
                return job.result()

            warm = chats[: args.clients]  # kernels, connections, the server's threads
            _direct(engine, warm, args)
            through_endpoint(warm)
            for r in range(args.repeats):
                log(f"round {r + 1}/{args.repeats}: {len(chats)} episodes directly, "
                    "then through the endpoint")  # fmt: skip
                direct, direct_s = _direct(engine, chats, args)
                endpoint, endpoint_s = through_endpoint(chats)
                rounds.append((len(chats) / direct_s, len(chats) / endpoint_s))
    return rounds, direct, endpoint


def _params(args: argparse.Namespace):
    """What a request of the endpoint runs with (`requests.py`): the server's
    distribution, max_tokens, no stop strings."""
    from colonnade.engine import SamplingParams

    return SamplingParams(max_turn_tokens=args.tokens + 1, max_episode_tokens=args.tokens)


def _direct(engine, chats: list, args: argparse.Namespace) -> tuple[list[list[int]], float]:
    from colonnade.engine.loop import seeded_keys
    from colonnade.protocol.turns import chat_prompt

    prompts = [chat_prompt(engine.tokenizer, m) for m in chats]
    keys = [seeded_keys(i, 1)[0] for i in range(len(prompts))]  # request i's seed is i
    n = len(prompts)
    t = time.perf_counter()
    eps = engine.generate(prompts, [_one_turn] * n, _params(args), max_rows=args.clients, keys=keys)
    return [ep.tokens for ep in eps], time.perf_counter() - t


def clients_run(url: str, model: str, chats: list, clients: int, max_tokens: int):
    """(token ids of each chat's completion, seconds): `clients` threads of
    one `openai` client, one request at a time each."""
    import threading
    from queue import Empty, SimpleQueue

    import openai

    client = openai.OpenAI(base_url=url, api_key="colonnade", max_retries=0, timeout=600)

    def ask(i: int) -> list[int]:
        r = client.chat.completions.create(
            model=model, messages=chats[i], max_tokens=max_tokens, seed=i,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        return r.choices[0].token_ids

    def drain(todo: SimpleQueue, out: dict) -> None:
        while True:
            try:
                i = todo.get_nowait()
            except Empty:
                return
            out[i] = ask(i)

    def timed(indices) -> tuple[dict, float]:
        todo: SimpleQueue = SimpleQueue()
        for i in indices:
            todo.put(i)
        out: dict = {}
        threads = [threading.Thread(target=drain, args=(todo, out)) for _ in range(clients)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return out, time.perf_counter() - t

    out, seconds = timed(range(len(chats)))
    if len(out) != len(chats):
        raise RuntimeError(f"{len(chats) - len(out)} requests failed")
    return [out[i] for i in range(len(chats))], seconds


def _one_turn(_text: str) -> None:
    return None


def _table(rows: list[dict]) -> str:
    head = (
        "| model | engine | episodes | clients | tokens/ep | direct ep/s | endpoint ep/s "
        "| ratio | same |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['engine']} {r['precision']} | {r['episodes']} | {r['clients']} "
            f"| {r['tokens_per_episode']} | {r['direct_episodes_s']} | {r['endpoint_episodes_s']} "
            f"| {r['endpoint_over_direct']} | {r['same_episodes']} |"
        )
    return "\n".join(lines)
