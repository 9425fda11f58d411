"""Rollout batches on the wire: protocol 3's binary form against protocol 2's JSON.

One realistic batch (by default 8 groups × 8 episodes × 512 tokens, vocab
49152: token ids Zipf-distributed over a shuffled vocabulary, float32
log-probs as the engine records them, tool replies in the mask), encoded and
decoded in each format side by side, in one run:

- `json`: protocol 2's form, kept here only to compare against (a private
  codec, not a second wire format): zstd over JSON lists of ids and floats,
  decoded with protocol 2's checks (the ids, mask and log-probs of every
  token checked one by one);
- `binary`: protocol 3's (`encode_batch` / `decode_batch`, as workers and
  the trainer run them): zstd over safetensors, int32 ids, float32 log-probs,
  uint8 mask;
- `binary-raw`: the same safetensors bytes without zstd, to show what the
  compression buys.

Columns: bytes uploaded (and before zstd), bytes a token, encode and decode
milliseconds (median of `--repeats` after one warm-up; decode is the
trainer's: bytes to a validated batch of Python lists), the decompression
bound the trainer sets for such a batch, and whether the decoded content
(and its replay digests) equals the original.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import zstandard

from colonnade import untrusted
from colonnade.choices import ENGINES
from colonnade.protocol.schemas import (
    FINISHES,
    MAX_BATCH_BYTES,
    EpisodeRecord,
    GroupRecord,
    RolloutBatch,
    batch_bytes_bound,
    check_worker_id,
    content_digest,
    decode_batch,
    dumps,
    encode_batch,
    loads,
    pack_batch,
    unpack_batch,
)
from colonnade.untrusted import is_int, is_number, need

FORMATS = ("json", "binary", "binary-raw")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=8, help="groups in the batch (default 8)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group (default 8)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per episode (default 512)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152)")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per row (median)")
    p.add_argument("--quick", action="store_true", help="2 groups x 4 episodes x 64 tokens")
    p.add_argument("--json", action="store_true", help="print result rows as JSON on stdout")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")


def log(msg: str) -> None:
    print(f"[bench batches] {msg}", file=sys.stderr, flush=True)


def make_batch(groups: int, group_size: int, tokens: int, vocab: int, seed: int = 0):
    """A batch as a worker uploads it: Zipf-like token ids (frequent tokens are
    few, as in text), float32 log-probs (most tokens likely, a long tail), and
    two tool replies an episode (mask 0, log-prob 0.0)."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(vocab)
    out = []
    for g in range(groups):
        eps = []
        for _ in range(group_size):
            ids = order[np.minimum(rng.zipf(1.15, tokens) - 1, vocab - 1)]
            mask = np.ones(tokens, dtype=bool)
            for start in sorted(rng.integers(1, max(2, tokens - 1), 2)):
                mask[start : start + max(1, tokens // 16)] = False
            lps = (-rng.exponential(0.6, tokens)).astype(np.float32)
            lps[~mask] = 0.0
            below = rng.random(tokens).astype(np.float32)
            below[~mask] = 0.0
            finish = str(rng.choice(FINISHES))
            eps.append(
                EpisodeRecord(ids.tolist(), mask.tolist(), lps.tolist(), finish, below.tolist())
            )
        out.append(GroupRecord(f"task-{g:05d}", eps))
    return RolloutBatch("worker-1", 12, 3, out, {"reward_claimed": 0.25}, "torch")


# -- protocol 2's JSON batches, for comparison only ------------------------------------


def _json_bound(episodes: int, max_tokens: int) -> int:
    return min(MAX_BATCH_BYTES, episodes * max_tokens * 40 + (64 << 10))


def _encode_json(batch: RolloutBatch) -> bytes:
    doc = asdict(batch)
    for g in doc["groups"]:
        g.pop("rewards")  # fields of later protocols: protocol 2 had none
        for e in g["episodes"]:
            e.pop("tools")
            e["from_model"] = "".join("1" if b else "0" for b in e["from_model"])
    return zstandard.ZstdCompressor(level=3).compress(dumps(doc))


def _json_episode(e, vocab: int, max_tokens: int) -> EpisodeRecord:
    need(isinstance(e, dict) and set(e) == {"tokens", "from_model", "logprobs", "finish", "below"},
         "episode fields")  # fmt: skip
    toks, mask, lps = e["tokens"], e["from_model"], e["logprobs"]
    need(isinstance(toks, list) and 0 < len(toks) <= max_tokens, "episode length")
    need(isinstance(mask, str) and len(mask) == len(toks) and set(mask) <= {"0", "1"},
         "from_model")  # fmt: skip
    need(isinstance(lps, list) and len(lps) == len(toks), "logprobs as long as tokens")
    need(all(is_int(t, 0, vocab - 1) for t in toks), "token id out of the vocabulary")
    need(all(is_number(x) and -1e4 <= x <= 0.0 for x in lps), "logprobs: finite, <= 0")
    need(mask[0] == "1", "an episode starts with a model token")
    need(e["finish"] in FINISHES, "finish")
    return EpisodeRecord(list(toks), [c == "1" for c in mask], [float(x) for x in lps], e["finish"],
                         [float(x) for x in e["below"]])  # fmt: skip


def _decode_json(data: bytes, vocab: int, max_tokens: int, max_raw: int) -> RolloutBatch:
    """Protocol 2's `decode_batch`, checks and all."""
    need(len(data) <= MAX_BATCH_BYTES, "batch too large")
    d = loads(untrusted.decompress(data, max_raw), max_raw)
    need(set(d) == {"worker", "version", "seq", "groups", "stats", "engine", "slot"}, "fields")
    need(d["engine"] in ENGINES, "engine")
    check_worker_id(d["worker"])
    need(is_int(d["version"]) and is_int(d["seq"]), "version/seq: integers")
    need(isinstance(d["stats"], dict) and all(is_number(v) for v in d["stats"].values()), "stats")
    groups = d["groups"]
    need(isinstance(groups, list) and groups, "groups: non-empty list")
    out = []
    for g in groups:
        need(isinstance(g, dict) and set(g) == {"task_id", "episodes"}, "group fields")
        need(isinstance(g["task_id"], str) and 0 < len(g["task_id"]) <= 256, "task_id")
        need(isinstance(g["episodes"], list) and g["episodes"], "episodes: non-empty list")
        out.append(
            GroupRecord(g["task_id"], [_json_episode(e, vocab, max_tokens) for e in g["episodes"]])
        )
    return RolloutBatch(d["worker"], d["version"], d["seq"], out, dict(d["stats"]), d["engine"],
                        d["slot"])  # fmt: skip


# -- the runs ----------------------------------------------------------------------------


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def measure(batch: RolloutBatch, vocab: int, max_tokens: int, repeats: int) -> list[dict]:
    episodes = sum(len(g.episodes) for g in batch.groups)
    tokens = sum(len(e.tokens) for g in batch.groups for e in g.episodes)
    bound = batch_bytes_bound(episodes, max_tokens, len(batch.groups))
    codecs = {
        "json": (
            _encode_json,
            lambda b: _decode_json(b, vocab, max_tokens, _json_bound(episodes, max_tokens)),
            lambda b: len(zstandard.ZstdDecompressor().decompress(b)),
            _json_bound(episodes, max_tokens),
        ),
        "binary": (
            encode_batch,
            lambda b: decode_batch(b, vocab, max_tokens, bound),
            lambda b: len(zstandard.ZstdDecompressor().decompress(b)),
            bound,
        ),
        "binary-raw": (pack_batch, lambda b: unpack_batch(b, vocab, max_tokens), len, None),
    }
    digests = [content_digest(g) for g in batch.groups]
    rows = []
    for name in FORMATS:
        encode, decode, raw_len, bound = codecs[name]
        data = encode(batch)
        got = decode(data)
        rows.append({
            "format": name,
            "groups": len(batch.groups),
            "episodes": episodes,
            "tokens": tokens,
            "vocab": vocab,
            "bytes": len(data),
            "raw_bytes": raw_len(data),
            "bytes_per_token": round(len(data) / tokens, 2),
            "encode_ms": _median_ms(lambda: encode(batch), repeats),  # noqa: B023
            "decode_ms": _median_ms(lambda: decode(data), repeats),  # noqa: B023
            "bound_bytes": bound,
            "same_content": got == batch,
            "same_digests": [content_digest(g) for g in got.groups] == digests,
        })  # fmt: skip
        log(f"{name}: {len(data)} bytes, encode {rows[-1]['encode_ms']} ms, "
            f"decode {rows[-1]['decode_ms']} ms")  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["format"] == "json"), rows[0])
    out = [
        "| format | bytes | before zstd | bytes/token | encode ms | decode ms | bytes vs json "
        "| decode vs json | bound | same content, digests |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = f"{r['bound_bytes']:,}" if r["bound_bytes"] else "–"
        out.append(
            f"| {r['format']} | {r['bytes']:,} | {r['raw_bytes']:,} | {r['bytes_per_token']} "
            f"| {r['encode_ms']} | {r['decode_ms']} | {r['bytes'] / base['bytes']:.2f}x "
            f"| {r['decode_ms'] / max(base['decode_ms'], 1e-9):.3f}x | {bound} "
            f"| {'yes' if r['same_content'] else 'NO'}, {'yes' if r['same_digests'] else 'NO'} |"
        )
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.groups, args.group_size, args.tokens, args.repeats = 2, 4, 64, 3
    batch = make_batch(args.groups, args.group_size, args.tokens, args.vocab)
    log(f"{args.groups} groups x {args.group_size} episodes x {args.tokens} tokens, "
        f"vocab {args.vocab}, median of {args.repeats}")  # fmt: skip
    rows = measure(batch, args.vocab, args.tokens, args.repeats)
    text = table(rows)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colonnade bench batches", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
