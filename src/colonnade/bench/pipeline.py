"""Episodes/s of a model run by a pipeline of stage-workers, against one whole-model worker.

`colonnade bench pipeline` runs the same episodes (fixed length: EOS
ignored, one turn) through one whole-model int8 engine and through groups
of stage-workers (`rollout/pipeline.py`): the first stage in this process,
every later stage in a process of its own, all of them reaching one local
store through the fleet bench's WAN view (`bench/fleet/wan.py`: every
request delayed by `--latency-ms`). With `--link tcp` the stages' messages
go over direct TCP links instead (`rollout/stagelink.py`, on loopback: the
latency then delays only the stages' reads of each other's addresses). One
row per (stages, latency, link, in-flight micro-batches): `episodes_s`
measured, `single_episodes_s` the whole worker's on this machine,
`predicted_episodes_s` the throughput model's.

The throughput model (docs/benchmarks.md): with E episodes of T tokens in
M micro-batches of b = E / M rows, a micro-batch's step takes one cycle

    C(b) = c(b) + N * hop,    hop = 2.5 * latency + o(b)

where c(b) is the whole model's step at b rows (measured on this machine)
and a hop is a put, then the reader's reads of the message's key, over and
over, each a round trip: the message lands halfway through one on average,
and the next finds it (one and a half); on a tcp link a hop is one push
over loopback, the reader's looks local: no round trip is counted (hop =
o(b)); o(b) is what a message costs beside
its round trips (packed, written to a local store, read, checked;
measured). The
stages work on different micro-batches at once, each taking a step at a
time, stage k for its share s_k of the weights (the head counted), on the
P processes' worth of compute the machine gives them at once (measured: N
processes of a fixed matmul loop together against one alone; `--cores`).
The M micro-batches go round a closed loop, each cycle N round-trip waits
(2.5 * latency a hop) and W(b) = c(b) + N * o(b) of compute (a step's
layers and its messages' packing and checks) queued for the cores, solved
by mean-value analysis (P cores as one queue of demand W / P beside a wait
of W - W / P, Seidmann's approximation):

    D = W(b) / P,  Z = N * 2.5 * latency + W(b) - D
    R_k = D * (1 + Q_{k-1}),  X_k = k / (R_k + Z),  Q_k = X_k * R_k,  k = 1 .. M
    steps/s = min(X_M, 1 / (max_k s_k * c(b)))
    episodes/s = b * steps/s / T

against one worker's E / (T * c(E)). At M = 1 it is 1 / C(b); as M grows
it reaches min(P / W(b), 1 / (max_k s_k * c(b))): on one core the stages'
compute never overlaps, only the round trips hide behind it; with a core
per stage and free messages (o = 0) the ends are the bound
min(M / C(b), 1 / (max_k s_k * c(b))) the model had before it counted
cores, and the knee between is lower, where micro-batches wait on each
other for a core.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("tiny", "smollm2-135m")
HOP_REQUESTS = 2.5  # a hop's round trips: the put, one and a half reads of its key
LINKS = ("store", "tcp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", choices=MODELS, help="model (default: tiny)")
    p.add_argument("--stages", default="2", help="comma list of stage counts (default 2)")
    p.add_argument(
        "--latency-ms", default="0,40", help="comma list of store round trips (default 0,40)"
    )
    p.add_argument("--in-flight", default="1,2,4", help="comma list of micro-batches in flight")
    p.add_argument(
        "--link", default="store",
        help="comma list of how the stages' messages travel: store (through the store), tcp "
        "(direct links on loopback) (default store)",
    )  # fmt: skip
    p.add_argument("--episodes", type=int, default=64, help="episodes a run (default 64)")
    p.add_argument("--tokens", type=int, default=16, help="tokens an episode (default 16)")
    p.add_argument(
        "--cores", type=float, default=None,
        help="processes' worth of compute the stages run at once, for the model "
        "(default: measured once for each number of stages)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the rows as JSON on stdout")


def log(msg: str) -> None:
    print(f"[bench pipeline] {msg}", file=sys.stderr, flush=True)


def _ints(text: str, what: str, low: int) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --{what}: a comma list of integers") from None
    if not out or min(out) < low:
        raise SystemExit(f"error: --{what}: integers >= {low}")
    return out


def run(args: argparse.Namespace) -> int:
    stages = _ints(args.stages, "stages", 2)
    latencies = _ints(args.latency_ms, "latency-ms", 0)
    in_flight = _ints(args.in_flight, "in-flight", 1)
    links = [x.strip() for x in args.link.split(",") if x.strip()]
    if not links or not set(links) <= set(LINKS):
        raise SystemExit(f"error: --link: a comma list of {', '.join(LINKS)}")
    if min(args.episodes, args.tokens) < 1:
        raise SystemExit("error: --episodes and --tokens must be >= 1")
    if args.cores is not None and args.cores <= 0:
        raise SystemExit("error: --cores must be > 0")
    rows = _rows(args, stages, latencies, in_flight, links)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
    return 0


def _model_path(name: str) -> str:
    from colonnade.envs import load_environment
    from colonnade.model import resolve_model

    texts = load_environment("searchqa").tokenizer_texts if name == "tiny" else None
    return resolve_model(name, texts)


class _Setup:
    """The model, its published int8 state, the whole engine and the episodes."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from colonnade.engine import SamplingParams, engine_for
        from colonnade.engine.loop import seeded_keys
        from colonnade.model import int8_state, load_model

        self.path = _model_path(args.model)
        model, self.tok = load_model(self.path)
        self.state = int8_state(model)
        self.whole = engine_for(model, self.tok, self.state, "int8", torch.device("cpu"))
        self.tokens, self.episodes = args.tokens, args.episodes
        self.params = SamplingParams(max_turn_tokens=args.tokens,
                                     max_episode_tokens=args.tokens, ignore_eos=True)  # fmt: skip
        self.prompts = [
            self.tok.encode(f"Question {i}: which protein does GX{i} bind to?")
            for i in range(args.episodes)
        ]
        self.keys = seeded_keys(7, args.episodes)
        self._steps: dict[int, float] = {}

    def responders(self, n: int) -> list:
        return [lambda text: None] * n

    def warm_up(self) -> None:
        rows = min(4, self.episodes)
        self.whole.generate(self.prompts[:rows], self.responders(rows), self.params,
                            keys=self.keys[:rows])  # fmt: skip

    def step_seconds(self, rows: int) -> float:
        """The whole model's seconds a step at `rows` rows (prefill included)."""
        if rows not in self._steps:
            t0 = time.perf_counter()
            self.whole.generate(self.prompts[:rows], self.responders(rows), self.params,
                                keys=self.keys[:rows])  # fmt: skip
            self._steps[rows] = (time.perf_counter() - t0) / self.tokens
        return self._steps[rows]


def _rows(args, stages: list[int], latencies: list[int], in_flight: list[int],
          links: list[str]) -> list[dict]:  # fmt: skip
    setup = _Setup(args)
    log(f"{args.model}: warming up, then one whole-model worker over {args.episodes} episodes")
    setup.warm_up()
    single_step = setup.step_seconds(args.episodes)
    single = args.episodes / (args.tokens * single_step)
    rows = []
    for n in stages:
        cores = args.cores if args.cores is not None else _measure_cores(n)
        log(f"{n} stages: {cores:.2f} processes' worth of compute at once")
        for latency in latencies:
            for link in links:
                rows.extend(_group_rows(setup, n, latency, link, in_flight, single, cores))
    return rows


def _group_rows(setup: _Setup, n: int, latency_ms: int, link: str, in_flight: list[int],
                single: float, cores: float):  # fmt: skip
    from transformers import AutoConfig

    from colonnade.engine.stages import build_stage, plan_stages
    from colonnade.model.loading import skeleton
    from colonnade.rollout.pipeline import Front, Group

    config = AutoConfig.from_pretrained(setup.path)
    plan = plan_stages(skeleton(setup.path), n)
    shares = _shares(setup.path, plan)
    first = build_stage(config, setup.state, plan[0])
    out = []
    with tempfile.TemporaryDirectory(prefix="colonnade-pipeline-") as tmp:
        root = Path(tmp) / "inbox"
        root.mkdir()
        procs = _start_stages(setup.path, root, Path(tmp), n, latency_ms, link)
        store = None
        try:
            store = _transport(root, 0, n, latency_ms, link)
            group = Group("bench", "g", tuple(f"w{k}" for k in range(n)))
            front = Front(first, store, group, setup.tok, config.vocab_size, timeout=600)
            for m in in_flight:
                front.in_flight = m
                log(f"{n} stages, {latency_ms} ms a request, {link}, {m} in flight")
                t0 = time.perf_counter()
                front.generate(setup.prompts, setup.responders(setup.episodes), setup.params,
                               setup.keys)  # fmt: skip
                seconds = time.perf_counter() - t0
                b = -(-setup.episodes // m)
                step = setup.step_seconds(b)
                message = _hop_overhead(setup, b)
                trips = HOP_REQUESTS * latency_ms / 1000 if link == "store" else 0.0
                hop = trips + message
                steps_s = predicted_steps_s(step, hop, m, shares, cores, message)
                out.append({
                    "model": Path(setup.path).name, "stages": n, "latency_ms": latency_ms,
                    "link": link, "in_flight": m, "episodes": setup.episodes,
                    "tokens": setup.tokens,
                    "episodes_s": round(setup.episodes / seconds, 3),
                    "single_episodes_s": round(single, 3),
                    "predicted_episodes_s": round(b * steps_s / setup.tokens, 3),
                    # The model's inputs, so that its terms can be read off a row.
                    "step_s": round(step, 4), "hop_s": round(hop, 4),
                    "message_s": round(message, 4), "cores": round(cores, 2),
                    "shares": [round(x, 3) for x in shares],
                    "layers": [[s.start, s.stop] for s in plan],
                })  # fmt: skip
        finally:
            (Path(tmp) / "stop").touch()
            rss = _stop(procs, Path(tmp))
            if store is not None and hasattr(store, "close"):
                store.close()
    for row in out:
        row["stage_rss_mb"] = rss
    return out


def predicted_steps_s(
    step_s: float, hop_s: float, in_flight: int, shares, cores: float, message_s: float = 0.0
) -> float:
    """Micro-batch steps/s of a pipeline (the module's model): whole-model
    step `step_s`, a hop `hop_s` of which `message_s` is compute, stage k
    holding `shares[k]` of the layers' compute, `cores` processes' worth of
    compute running at once."""
    work = step_s + len(shares) * message_s
    queued = work / cores
    wait = len(shares) * (hop_s - message_s) + work - queued
    waiting = 0.0  # micro-batches queued or computing, on average
    for k in range(1, in_flight + 1):
        residence = queued * (1 + waiting)
        steps_s = k / (residence + wait)
        waiting = steps_s * residence
    return min(steps_s, 1 / (max(shares) * step_s))


def _measure_cores(n: int, rounds: int = 2) -> float:
    """Processes' worth of compute `n` processes get at once here: n times
    one process's time for a fixed matmul loop alone over its time when all
    n run it together. Shared or busy cores bring it below n."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "colonnade.bench.pipeline", "probe"]
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]  # fmt: skip
    try:
        for p in procs:
            p.stdout.readline()  # torch imported, weights made: timing may start
        alone = together = 0.0
        for _ in range(rounds):
            alone += _probe_round(procs[:1])
            together += _probe_round(procs) / n
        return min(float(n), n * alone / together)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def _probe_round(procs: list) -> float:
    """The processes' seconds for one run of the loop each, all started at once, summed."""
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return sum(float(p.stdout.readline()) for p in procs)


def _probe(iterations: int = 60) -> None:
    """A probe process: a weight too big for the caches, streamed through a
    matmul the way a step streams a layer's, timed once per `go` line."""
    import torch

    w, x = torch.randn(4096, 2048), torch.randn(16, 2048)
    print("ready", flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        for _ in range(iterations):
            x @ w.T
        print(time.perf_counter() - t0, flush=True)


def _hop_overhead(setup: _Setup, rows: int, repeats: int = 20) -> float:
    """Seconds a decode step's message of `rows` rows costs beside the round
    trips: packed, written to a local store (fsynced), read and checked."""
    import numpy as np

    from colonnade.protocol.stages import Binding, Step, pack_step, unpack_step
    from colonnade.store import LocalStore

    hidden = setup.whole.backend.model.config.get_text_config().hidden_size
    bind = Binding("bench", "g", 0, 0, 0, 0)
    step = Step(bind, 0, [], np.zeros((rows, 1, hidden), np.float32),
                np.zeros((rows, 1), np.int64), np.ones((rows, 64), bool))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(tmp)
        t0 = time.perf_counter()
        for _ in range(repeats):
            store.put("m", pack_step(step))
            unpack_step(store.get("m"), bind, hidden)
        return (time.perf_counter() - t0) / repeats


def _shares(path: str, plan) -> list[float]:
    """Each stage's share of the weights a step streams (the head on the last)."""
    from colonnade.model.loading import skeleton

    model = skeleton(path)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    head = sum(p.numel() for p in model.get_output_embeddings().parameters())
    cost = [sum(layers[s.start : s.stop]) + (head if s.last else 0) for s in plan]
    return [c / sum(cost) for c in cost]


def _wan(root: Path, client: str, latency_ms: int):
    from colonnade.bench.fleet.wan import Link, Tally, WanStore
    from colonnade.store import LocalStore

    return WanStore(LocalStore(root), client, Tally(), Link(latency_ms / 1000))


def _transport(root: Path, k: int, n: int, latency_ms: int, link: str):
    """Where stage k's messages travel: the store seen through its WAN view,
    or a direct link on loopback (its address read through that view)."""
    from colonnade.rollout.pipeline import Group
    from colonnade.rollout.stagelink import open_link

    store = _wan(root, f"w{k}", latency_ms)
    if link == "store":
        return store
    group = Group("bench", "g", tuple(f"w{i}" for i in range(n)))
    return open_link(group, k, store, listen="127.0.0.1:0", timeout=600)


def _start_stages(path: str, root: Path, tmp: Path, n: int, latency_ms: int,
                  link: str) -> list:  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    for k in range(1, n):
        argv = [sys.executable, "-m", "colonnade.bench.pipeline", path, str(root), str(tmp),
                str(k), str(n), str(latency_ms), link]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env))
    deadline = time.monotonic() + 600
    while not all((tmp / f"ready-{k}").exists() for k in range(1, n)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _stop(procs, tmp)
            raise SystemExit("error: a stage process did not start")
        time.sleep(0.1)
    return procs


def _stop(procs: list, tmp: Path) -> list[float]:
    (tmp / "stop").touch()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    rss = []
    for k in range(1, len(procs) + 1):
        f = tmp / f"rss-{k}"
        rss.append(float(f.read_text()) if f.exists() else float("nan"))
    return rss


def _serve(argv: list[str]) -> None:
    """A later stage in its own process, until the stop file appears; its
    resident memory (MB) at the end, its caches still held, written beside it."""
    from transformers import AutoConfig

    from colonnade.engine.stages import build_stage, plan_stages
    from colonnade.model import int8_state, load_model
    from colonnade.model.loading import skeleton
    from colonnade.rollout.pipeline import Group, StageServer

    path, root, tmp, k, n, latency_ms, link = argv
    k, n, tmp = int(k), int(n), Path(tmp)
    config = AutoConfig.from_pretrained(path)
    stage = plan_stages(skeleton(path), n)[k]
    # The whole state is made here only because the bench has no published
    # run to read a stage's tensors from; the stage keeps its own.
    state = int8_state(load_model(path)[0])
    backend = build_stage(config, state, stage)
    del state
    gc.collect()
    group = Group("bench", "g", tuple(f"w{i}" for i in range(n)))
    store = _transport(Path(root), k, n, int(latency_ms), link)
    server = StageServer(backend, store, group, config.hidden_size)
    (tmp / f"ready-{k}").touch()
    server.serve(lambda: (tmp / "stop").exists())
    (tmp / f"rss-{k}").write_text(str(_resident_mb()))


def _resident_mb() -> float:
    """This process's resident memory now (Linux; NaN elsewhere). Not the
    peak: the bench loads the whole model first to make the published state."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return float("nan")


def _table(rows: list[dict]) -> str:
    head = ["stages", "latency_ms", "link", "in_flight", "episodes_s", "single_episodes_s",
            "predicted_episodes_s"]  # fmt: skip
    lines = ["  ".join(f"{h:>20}" for h in head)]
    lines += ["  ".join(f"{r[h]!s:>20}" for h in head) for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    _probe() if sys.argv[1:] == ["probe"] else _serve(sys.argv[1:])
