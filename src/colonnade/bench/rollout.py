"""Rollout throughput: our engines in fp32 and int8 against transformers' `generate`.

Side by side in one run, per model and batch size: generated tokens/s of
colonnade's torch engine with float32 weights, with the PULSE int8 weights
(weight-only int8 kernel), of `model.generate` (float32, sampling, KV cache)
on the same prompt, and, where MLX is installed, of the MLX engine in
float32, bfloat16 and int8 (the same published codes in MLX's 8-bit
layout); and the process's peak RSS during each row. Every configuration is
warmed up once, then timed `--repeats` times, the configurations of a batch
size in turn; the median is reported.

With `--compile both` (the default) every batch size has two rows: the
torch engines stepping eagerly (`compiled: false`) and with their step
compiled (`compiled: true`, `colonnade.engine.torch_compile`), fp32 and
int8 each over the same model as the eager row's; the runs of both rows'
engines and of `generate` (measured once, shown in both) are interleaved.

It also says what machine the figures come from: the CPU model (also on
every row), the int8 kernel chosen for each (shape, row bucket) (measured
afresh in this run, see `colonnade.model.kernels`), and the memory
bandwidth of a copy of a large array (bytes read plus bytes written,
STREAM's convention), against which each row states the fraction the
engine reaches: bytes of linear weights read per step × steps per second ÷
that bandwidth (`bandwidth_fraction`: int8's).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

import torch

from colonnade.model.device import peak_memory_mb
from colonnade.model.kernels import planner

MODELS = ("tiny", "smollm2-135m")
COMPILE_CHOICES = ("both", "off", "on")
PROMPT = "What protein does the gene GX12 encode? Search before answering."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help="comma list (default: %(default)s)")
    p.add_argument("--batches", default="1,8,32", help="batch sizes (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per episode (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="tiny model, batches 1,8, 16 tokens")
    p.add_argument("--json", action="store_true", help="print result rows as JSON on stdout")
    p.add_argument("--no-mlx", action="store_true", help="leave out the MLX rows")
    p.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="both",
        help="torch rows stepping eagerly (off), compiled (on), or both side by side "
        "(default %(default)s)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="groups rows: searchqa episodes per task, int8 engine (0: no groups rows; default 8)",
    )
    p.add_argument(
        "--group-tasks", type=int, default=8, help="groups rows: tasks (default %(default)s)"
    )
    p.add_argument(
        "--max-rows",
        type=int,
        default=16,
        help="groups rows: episodes running at once on both paths (default %(default)s)",
    )
    p.add_argument(
        "--groups-model",
        metavar="MODEL",
        help="groups rows: measure this model (preset or directory, e.g. a warm start "
        "that searches) once, instead of each of --models",
    )
    p.add_argument(
        "--groups-env",
        default="searchqa",
        metavar="ENV",
        help="groups rows: the environment (default %(default)s; searchqa2 is multi-hop)",
    )
    t = p.add_argument_group(
        "tools rows",
        "episodes that wait on a real tool service (bench/tools.py), int8 engine: rows of "
        'kind "tools", the rows that wait parked beside the batch (async) and the batch '
        "waiting for each call, per latency",
    )
    t.add_argument(
        "--tool-latency-ms",
        type=float,
        nargs="+",
        metavar="MS",
        help="the service's latencies, the first the fast one (e.g. 0 200; unset: no tools rows)",
    )
    t.add_argument(
        "--tool-tail-ms", type=float, default=2000.0, help="the slowest calls' wait (default 2000)"
    )
    t.add_argument(
        "--tool-tail-share", type=float, default=0.05, help="the slowest calls' share (0.05)"
    )
    t.add_argument("--tool-episodes", type=int, default=32, help="episodes a run (default 32)")
    t.add_argument("--tool-calls", type=int, default=3, help="calls an episode (default 3)")
    t.add_argument("--tool-turn-tokens", type=int, default=16,
                   help="tokens a turn, each ending in a call (default 16)")  # fmt: skip


def log(msg: str) -> None:
    print(f"[bench rollout] {msg}", file=sys.stderr, flush=True)


def _peak_reset() -> None:
    # Linux: writing 5 resets VmHWM to the current RSS, so each row's peak
    # is its own. Elsewhere the figure is the process's lifetime peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_mb() -> float:
    return peak_memory_mb(torch.device("cpu"))


def _tiny_texts() -> list[str]:
    from colonnade.envs import load_environment

    return load_environment("searchqa").tokenizer_texts()


def load_engines(name: str, mlx: bool) -> dict:
    """{label: engine} for a preset on CPU: torch fp32 and int8, MLX ones if asked."""
    from colonnade.engine import load_engine
    from colonnade.model import resolve_model

    path = resolve_model(name, _tiny_texts() if name == "tiny" else None)
    engines = {"fp32": load_engine(path, "fp32", "cpu"), "int8": load_engine(path, "int8", "cpu")}
    engines["int8_apart"] = _int8_apart(path)
    if mlx:
        for precision in ("fp32", "bf16", "int8"):
            engines[f"mlx_{precision}"] = load_engine(path, precision, engine="mlx")
    return engines


def compiled_engines(engines: dict) -> tuple[dict, float]:
    """({"fp32", "int8"}: the same models with their step compiled, compiled
    now), and the seconds the int8 step took to compile."""
    from colonnade.engine import Engine
    from colonnade.engine.torch_backend import TorchBackend

    out, seconds = {}, 0.0
    for label in ("fp32", "int8"):
        b = engines[label].backend
        backend = TorchBackend(b.model, b.precision, b.aliases, compile="on")
        t = time.perf_counter()
        with torch.inference_mode():
            backend.prepare()
        if label == "int8":
            seconds = time.perf_counter() - t
        out[label] = Engine(backend, engines[label].tokenizer)
    return out, seconds


def _int8_apart(path: str):
    """The int8 engine with every linear called on its own (no `Siblings`):
    what fusing sibling linears gains, measured beside it."""
    from colonnade.engine import Engine
    from colonnade.engine.torch_backend import TorchBackend
    from colonnade.model import int8_state, load_int8, load_model, tied_aliases

    model, tok = load_model(path, dtype=torch.float32)
    aliases = tied_aliases(model)  # before the load: an int8 model no longer shows its ties
    model = load_int8(model, int8_state(model), aliases, fuse=False).eval()
    return Engine(TorchBackend(model, "int8", aliases), tok)


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second moved by copying an `nbytes` array (read + write), best of runs."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched before timing
    best = min(_seconds(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bandwidth_bytes(quick: bool) -> int:
    """Large enough to leave every cache: twice the last-level cache, at least 1 GiB."""
    if quick:
        return 64 << 20
    llc = 0
    try:
        for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
            with open(f) as fh:
                text = fh.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            llc = max(llc, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return max(1 << 30, 2 * llc)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of linear weights (codes and scales, or float weights) one forward step reads."""
    from colonnade.model.int8 import Int8Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.codes.nbytes + m.scale.nbytes
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def _time(fn, repeats: int) -> tuple[float, float]:
    """(median tokens/s, peak RSS MB) of `fn`, which returns tokens generated."""
    fn()  # warm-up: first calls at a shape are slower
    rates, peak = [], 0.0
    for _ in range(repeats):
        _peak_reset()
        t = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t))
        peak = max(peak, _peak_mb())
    return statistics.median(rates), peak


def _interleaved(fns: dict, repeats: int) -> tuple[dict, float]:
    """({label: median tokens/s}, peak RSS MB) of `fns`, which return tokens
    generated, their runs interleaved: a shared machine's load then falls on
    each alike, which consecutive runs per configuration do not promise."""
    for fn in fns.values():
        fn()  # warm-up: first calls at a shape are slower
    rates: dict = {label: [] for label in fns}
    peak = 0.0
    for _ in range(repeats):
        for label, fn in fns.items():
            _peak_reset()
            t = time.perf_counter()
            n = fn()
            rates[label].append(n / (time.perf_counter() - t))
            peak = max(peak, _peak_mb())
    return {label: statistics.median(r) for label, r in rates.items()}, peak


def measure(
    sides: dict[bool, dict], batch: int, tokens: int, repeats: int, bandwidth: float = 0.0
) -> list[dict]:
    """This batch's rows, one per side ({compiled: engines}, from `load_engines`
    stepping eagerly and from `compiled_engines`), all their runs and
    `generate`'s (on fp32's model) interleaved."""
    from colonnade.engine import SamplingParams

    fp32 = next(iter(sides.values()))["fp32"]
    tok = fp32.tokenizer
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(max_turn_tokens=tokens, max_episode_tokens=tokens, ignore_eos=True)

    def ours(engine):
        eps = engine.generate([prompt] * batch, [lambda _t: None] * batch, params, seed=0)
        return sum(len(e.tokens) for e in eps)

    ids = torch.tensor([prompt] * batch)

    def hf():
        with torch.inference_mode():
            out = fp32.backend.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=tok.pad_token_id,
            )
        return (out.shape[1] - ids.shape[1]) * batch

    fns = {
        (side, label): (lambda e=engine: ours(e))
        for side, engines in sides.items()
        for label, engine in engines.items()
    }
    rates, peak = _interleaved({**fns, "generate": hf}, repeats)
    rows = []
    for side, engines in sides.items():
        mine = {label: rates[(side, label)] for label in engines}
        row = _row(engines, mine, rates["generate"], batch, bandwidth)
        rows.append({"compiled": side, **row, "peak_rss_mb": round(peak, 1)})
    return rows


def _row(engines: dict, rates: dict, hf_rate: float, batch: int, bandwidth: float) -> dict:
    row = {"batch": batch, **{f"{k}_tok_s": round(r, 1) for k, r in rates.items()}}
    row["hf_generate_tok_s"] = round(hf_rate, 1)
    row["int8_over_fp32"] = round(rates["int8"] / rates["fp32"], 2)
    if "int8_apart" in rates:
        row["fused_over_apart"] = round(rates["int8"] / rates["int8_apart"], 2)
    row["ours_fp32_over_generate"] = round(rates["fp32"] / hf_rate, 2)
    if "mlx_int8" in rates:
        row["mlx_int8_over_torch_int8"] = round(rates["mlx_int8"] / rates["int8"], 2)
    if bandwidth:
        for label in ("fp32", "int8"):
            steps_s = rates[label] / batch
            share = weight_bytes(engines[label].backend.model) * steps_s / bandwidth
            row[f"{label}_bandwidth_fraction"] = round(share, 3)
        row["bandwidth_fraction"] = row["int8_bandwidth_fraction"]
    return row


def measure_groups(
    engine, group_size: int, n_tasks: int, max_rows: int, repeats: int, env_name: str = "searchqa"
) -> dict:
    """Episodes/s on `env_name` (searchqa: multi-turn, real tool replies) at `group_size`,
    today's path against prefix sharing + refill, same tasks (sampling seeds
    per `generate` call, so not the same draws).

    Today's path is a worker's: a batch of whole groups (`max_rows` rows)
    per `generate`, every row prefilling its prompt, the batch shrinking to
    its slowest row. The other runs all the groups in one `generate` with
    at most `max_rows` rows at once, a group's prompt prefilled once and
    waiting groups joining as episodes end.
    """
    from colonnade.engine import SamplingParams
    from colonnade.envs import load_environment
    from colonnade.rollout.episodes import run_episodes

    env = load_environment(env_name)
    tasks = list(env.tasks("train"))[:n_tasks]
    params = SamplingParams()  # a worker's defaults: 96 tokens a turn, 512 an episode
    per_call = max(1, max_rows // group_size)
    turns: list[int] = []  # model turns of every episode, both paths

    def today() -> int:
        done = 0
        for i in range(0, len(tasks), per_call):
            chunk = [t for t in tasks[i : i + per_call] for _ in range(group_size)]
            results = run_episodes(
                engine, env, chunk, params, seed=i, share_prefix=False, split_replies=False
            )
            turns.extend(len(r.episode.turns) for r in results)
            done += len(results)
        return done

    def shared() -> int:
        rows = [t for t in tasks for _ in range(group_size)]
        results = run_episodes(engine, env, rows, params, seed=0, max_rows=max_rows)
        turns.extend(len(r.episode.turns) for r in results)
        return len(results)

    base, _ = _time(today, repeats)
    new, _ = _time(shared, repeats)
    return {
        "kind": "groups",
        "env": env_name,
        "group_size": group_size,
        "tasks": len(tasks),
        "max_rows": max_rows,
        # Model turns an episode: 1 where the model never searched (no tool reply).
        "turns_mean": round(statistics.fmean(turns), 2),
        "baseline_episodes_s": round(base, 3),
        "shared_episodes_s": round(new, 3),
        "shared_over_baseline": round(new / base, 2),
    }


def run(args: argparse.Namespace) -> int:
    models = ["tiny"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    tokens = 16 if args.quick else args.tokens
    bad = [m for m in models if m not in MODELS]
    if bad or not batches or min(batches) < 1 or tokens < 1 or args.repeats < 1:
        raise SystemExit(f"error: models must be among {MODELS}; batches, tokens, repeats >= 1")
    if args.group_size < 0 or args.group_tasks < 1 or args.max_rows < max(args.group_size, 1):
        raise SystemExit("error: --group-size >= 0, --group-tasks >= 1, --max-rows >= group size")
    tool_ms = args.tool_latency_ms or []
    if tool_ms and (
        min(tool_ms) < 0
        or min(args.tool_episodes, args.tool_calls, args.tool_turn_tokens) < 1
        or args.tool_tail_ms < 0
        or not 0 <= args.tool_tail_share <= 1
    ):
        raise SystemExit(
            "error: --tool-latency-ms and --tool-tail-ms >= 0, --tool-tail-share within [0, 1], "
            "--tool-episodes, --tool-calls, --tool-turn-tokens >= 1"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    mlx = not args.no_mlx and _mlx_or_say()
    size = bandwidth_bytes(args.quick)
    log(f"memory bandwidth: copying {size >> 20} MiB")
    bandwidth = copy_bandwidth(size)
    planner().forget()  # this run's kernels, measured now (and cached)
    rows = []
    for name in models:
        log(f"loading {name} (fp32 and int8{', and MLX' if mlx else ''})")
        engines = load_engines(name, mlx)
        rows += _model_rows(name, engines, batches, tokens, args, bandwidth)
        if args.group_size > 0 and not args.groups_model:
            rows.append({"model": name, **_groups(args, engines["int8"])})
        if tool_ms:
            rows += [{"model": name, **r} for r in _tools(args, engines["int8"])]
    if args.group_size > 0 and args.groups_model:
        from colonnade.engine import load_engine
        from colonnade.model import resolve_model

        log(f"loading {args.groups_model} (int8) for the groups rows")
        engine = load_engine(resolve_model(args.groups_model), "int8", "cpu")
        rows.append({"model": args.groups_model, **_groups(args, engine)})
    machine = machine_row(bandwidth)
    if args.json:
        print(json.dumps([*rows, machine], indent=2))
    else:
        print(markdown_table([r for r in rows if "kind" not in r], mlx))
        print(groups_table([r for r in rows if r.get("kind") == "groups"]))
        if tool_ms:
            from .tools import tools_table

            print(tools_table([r for r in rows if r.get("kind") == "tools"]))
        print(machine_text(machine))
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores")
    return 0


def _model_rows(name, engines, batches, tokens, args, bandwidth) -> list[dict]:
    """Each batch's rows for one model: eager, compiled, or both (`--compile`)."""
    from colonnade.model.kernels import cpu_model

    sides = {} if args.compile == "on" else {False: engines}
    compile_s = 0.0
    if args.compile != "off":
        log(f"{name}: compiling the torch fp32 and int8 steps")
        sides[True], compile_s = compiled_engines(engines)
    rows = []
    for b in batches:
        log(f"{name}: batch {b}, {tokens} tokens, {args.repeats} repeats")
        eager = None
        for row in measure(sides, b, tokens, args.repeats, bandwidth):
            row = {"model": name, "cpu": cpu_model(), **row}
            if row["compiled"]:
                # What the row ran: False where the compiler failed (logged).
                row["compiled"] = all(e.backend.compiled for e in sides[True].values())
                row["compile_s"] = round(compile_s, 1)
                if eager is not None:
                    row["compiled_over_eager"] = round(row["int8_tok_s"] / eager["int8_tok_s"], 2)
            else:
                eager = row
            rows.append(row)
    return rows


def _groups(args: argparse.Namespace, engine) -> dict:
    tasks = 2 if args.quick else args.group_tasks
    log(f"groups of {args.group_size}, {tasks} {args.groups_env} tasks, int8")
    return measure_groups(
        engine, args.group_size, tasks, args.max_rows, args.repeats, args.groups_env
    )


def _tools(args: argparse.Namespace, engine) -> list[dict]:
    from .tools import measure_tools

    episodes = 4 if args.quick else args.tool_episodes
    log(f"tools: {episodes} episodes of {args.tool_calls} calls, int8")
    return measure_tools(
        engine,
        args.tool_latency_ms,
        args.tool_tail_ms,
        args.tool_tail_share,
        episodes,
        args.tool_calls,
        args.tool_turn_tokens,
        args.repeats,
        log,
    )


def machine_row(bandwidth: float) -> dict:
    """The machine the rows come from, and the int8 kernels chosen on it."""
    from colonnade.model.kernels import cpu_model

    return {
        "kind": "machine",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "int8_kernels": planner().summary(),
    }


def groups_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    head = (
        "\n| model | env | group size | tasks | max rows | model turns an episode "
        "| today episodes/s | shared + refill episodes/s | ratio |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    body = [
        f"| {r['model']} | {r['env']} | {r['group_size']} | {r['tasks']} | {r['max_rows']} "
        f"| {r['turns_mean']} "
        f"| {r['baseline_episodes_s']} | {r['shared_episodes_s']} | {r['shared_over_baseline']} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def machine_text(m: dict) -> str:
    kernels = ", ".join(f"{slot} {name}" for slot, name in m["int8_kernels"].items())
    return (
        f"\nCPU: {m['cpu']} ({m['cores']} cores, {m['threads']} threads, "
        f"{m['cpu_capability']}), torch {m['torch']}, copy bandwidth "
        f"{m['copy_bandwidth_gb_s']} GB/s\nint8 kernels (out x in @ rows): {kernels}"
    )


def _mlx_or_say() -> bool:
    from colonnade.engine.mlx_backend import mlx_missing

    reason = mlx_missing()
    if reason:
        log(f"no MLX rows: {reason}")
    return reason is None


COLUMNS = [
    ("model", "model"),
    ("batch", "batch"),
    ("compiled", "compiled"),
    ("ours fp32 tok/s", "fp32_tok_s"),
    ("ours int8 tok/s", "int8_tok_s"),
    ("int8 unfused tok/s", "int8_apart_tok_s"),
    ("generate tok/s", "hf_generate_tok_s"),
    ("int8/fp32", "int8_over_fp32"),
    ("compiled/eager int8", "compiled_over_eager"),
    ("fused/unfused", "fused_over_apart"),
    ("ours fp32/generate", "ours_fp32_over_generate"),
    ("fp32 BW share", "fp32_bandwidth_fraction"),
    ("int8 BW share", "int8_bandwidth_fraction"),
    ("peak RSS MB", "peak_rss_mb"),
]
MLX_COLUMNS = [
    ("mlx fp32 tok/s", "mlx_fp32_tok_s"),
    ("mlx bf16 tok/s", "mlx_bf16_tok_s"),
    ("mlx int8 tok/s", "mlx_int8_tok_s"),
    ("mlx int8/torch int8", "mlx_int8_over_torch_int8"),
]


def markdown_table(rows: list[dict], mlx: bool = False) -> str:
    columns = COLUMNS[:-1] + (MLX_COLUMNS if mlx else []) + COLUMNS[-1:]
    head = "| " + " | ".join(h for h, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(str(r.get(k, "")) for _, k in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/rollout.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
