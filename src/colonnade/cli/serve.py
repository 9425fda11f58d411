"""`colonnade serve`: an OpenAI-compatible endpoint over the rollout engine."""

from __future__ import annotations

import argparse
import logging
import sys

from colonnade.choices import ENGINE_CHOICES, RUN_PRECISIONS

DESCRIPTION = (
    "Serve a model over HTTP, OpenAI-compatible under /v1 (GET /v1/models, POST "
    "/v1/chat/completions, POST /v1/completions), on the engine a worker runs: requests "
    "that arrive while others run join the running batch (continuous batching). With "
    "logprobs each sampled token's log-prob is returned, and with vLLM's return_token_ids "
    "the prompt's and the completion's token ids. The sampling distribution is the "
    "server's (--temperature, --top-p, --top-k): a request naming another is refused, so "
    "every log-prob returned is of one distribution. A request's seed fixes its draws: "
    "the same request gives the same tokens. A published version of a run (--model "
    "STORE@vN) is rebuilt from the store as a worker rebuilds it and runs at the run's "
    "published precision. See docs/serving.md."
)


def register(sub: argparse._SubParsersAction) -> None:
    from .export import published_flags

    p = sub.add_parser(
        "serve",
        usage="colonnade serve --model DIR|PRESET|STORE@vN [--port N] [--engine torch|mlx]",
        help="an OpenAI-compatible endpoint over the rollout engine (token ids, log-probs)",
        description=DESCRIPTION,
    )
    p.add_argument(
        "--model",
        required=True,
        help="model directory, preset (tiny: the one a searchqa run trains) or hub name; or a "
        "published version of a run: STORE@vN (a store folder, run directory or s3:// "
        "prefix; STORE alone: its newest)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: any)")
    p.add_argument("--engine", default="torch", choices=ENGINE_CHOICES, help="rollout engine")
    p.add_argument(
        "--precision",
        choices=RUN_PRECISIONS,
        help="of a model (default int8, as workers run it); a published version runs at its run's",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | mps | auto (torch engine)")
    p.add_argument("--served-model-name", help="the `model` clients name (default: --model)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    s = p.add_argument_group("sampling: the server's, every request's")
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    s.add_argument("--top-p", type=float, default=1.0, help="1: off (default)")
    s.add_argument("--top-k", type=int, default=0, help="0: off (default)")
    b = p.add_argument_group("bounds")
    b.add_argument("--max-rows", type=int, default=32, help="episodes running at once (32)")
    b.add_argument("--max-tokens", type=int, default=1024, help="a request's max_tokens (1024)")
    b.add_argument(
        "--max-prompt-tokens", type=int, default=4096, help="a request's prompt (4096 tokens)"
    )
    b.add_argument("--max-n", type=int, default=16, help="a request's n (16)")
    b.add_argument(
        "--max-waiting", type=int, default=1024, help="episodes queued before 503s (1024)"
    )
    b.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds a request may wait (600)"
    )
    published_flags(p)
    p.set_defaults(handler=_serve)


def _check(args: argparse.Namespace) -> None:
    from .main import CliError

    if not 0 <= args.port <= 65535:
        raise CliError("--port must be from 0 to 65535")
    if min(args.max_rows, args.max_tokens, args.max_prompt_tokens, args.max_n) < 1:
        raise CliError("--max-rows, --max-tokens, --max-prompt-tokens and --max-n must be >= 1")
    if args.max_waiting < args.max_n or args.request_timeout <= 0:
        raise CliError("--max-waiting must be at least --max-n, --request-timeout above 0")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise CliError("--temperature >= 0, --top-k >= 0 and --top-p in (0, 1]")


def _engine(args: argparse.Namespace):
    """The engine --model names: a model at --precision, or a published version."""
    from colonnade.operate.export import names_a_run

    if names_a_run(args.model):
        return _published(args)
    from colonnade.engine import load_engine
    from colonnade.envs import load_environment, tokenizer_texts_of
    from colonnade.model import resolve_model

    # The tiny preset's tokenizer is learnt from an environment's text: the
    # searchqa one, which a default run trains (read for tiny only).
    path = resolve_model(args.model, lambda: tokenizer_texts_of(load_environment("searchqa")))
    return load_engine(path, args.precision or "int8", args.device, engine=args.engine)


def _published(args: argparse.Namespace):
    """A published version, rebuilt as a worker rebuilds it (`launch.evaluation`)."""
    from .export import published_engine

    return published_engine(args)[0]


def _context(engine) -> int | None:
    """The model's positions, where its config names them."""
    config = getattr(getattr(engine.backend, "model", None), "config", None)
    return getattr(config, "max_position_embeddings", None)


def _serve(args: argparse.Namespace) -> int:
    from colonnade.engine import BackendUnavailable, SamplingParams
    from colonnade.serve import Bounds, Served, Server

    from .export import read_errors
    from .main import CliError

    _check(args)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        engine = _engine(args)
    except (FileNotFoundError, BackendUnavailable, *read_errors()) as e:
        raise CliError(str(e)) from None
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    bounds = Bounds(
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        context=_context(engine),
        max_n=args.max_n,
        max_episodes=max(args.max_n, Bounds.max_episodes),
    )
    served = Served(args.served_model_name or args.model, sampling, bounds)
    try:
        server = Server(engine, served, args.max_rows, args.host, args.port, args.max_waiting,
                        args.request_timeout)  # fmt: skip
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    print(
        f"serving {served.name} (v{engine.version}, {engine.name}) at {server.url}; "
        f"temperature {args.temperature:g}, top-p {args.top_p:g}, top-k {args.top_k}",
        file=sys.stderr,
        flush=True,
    )
    # The engine runs on this thread, the one that built it (MLX's streams are per thread).
    server.serve()
    return 0
