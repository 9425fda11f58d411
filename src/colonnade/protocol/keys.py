"""Object keys of protocol v3, all relative to the run prefix (docs/protocol.md).

| key                                        | writer         |
|--------------------------------------------|----------------|
| run.json                                   | trainer, once  |
| model/{file}                               | trainer, once  |
| weights/{v:08d}/patch.pulse                | trainer (v ≥ 1) |
| weights/{v:08d}/full.safetensors           | trainer (anchors) |
| weights/{v:08d}/meta.json                  | trainer, last  |
| weights/latest.json                        | trainer (hint) |
| rollouts/{v:08d}/{worker}/{seq:06d}.safetensors.zst | worker |
| workers/{worker}.json                      | worker         |
| trainer/...                                | trainer        |
| metrics/{role}-{id}/{seg:06d}.jsonl        | each process   |
| report/launch.json, report/eval-*.json     | colonnade run  |
"""

from __future__ import annotations

import re

# 2: hashes name their algorithm (BLAKE3 tree hashes by default), PULSE format 2.
# 3: rollout batches are binary: zstd over safetensors (int32 ids, float32 log-probs).
PROTOCOL_VERSION = 3
RUN = "run.json"
LATEST = "weights/latest.json"
DONE = "trainer/done.json"
HEARTBEAT = "trainer/heartbeat.json"
KEYRING = "trainer/keys.json"
QUARANTINE = "trainer/quarantine.json"
LAUNCH = "report/launch.json"
EVAL = {"before": "report/eval-before.json", "after": "report/eval-after.json"}
ROLLOUT_EXT = ".safetensors.zst"

# fullmatch with explicit ASCII classes: `$` would let a trailing newline
# through, and `\d` any Unicode digit.
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ROLLOUT = re.compile(
    r"rollouts/([0-9]{8})/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/([0-9]{6})\.safetensors\.zst"
)


def check_worker_id(worker: str) -> str:
    if not isinstance(worker, str) or not _WORKER_ID.fullmatch(worker):
        raise ValueError(
            f"invalid worker id {worker!r}: 1-64 of letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    return worker


def model_file(name: str) -> str:
    return f"model/{name}"


def weights_dir(v: int) -> str:
    return f"weights/{v:08d}/"


def full_key(v: int) -> str:
    return f"{weights_dir(v)}full.safetensors"


def patch_key(v: int) -> str:
    return f"{weights_dir(v)}patch.pulse"


def meta_key(v: int) -> str:
    return f"{weights_dir(v)}meta.json"


def rollouts_dir(v: int) -> str:
    return f"rollouts/{v:08d}/"


def rollout_key(v: int, worker: str, seq: int) -> str:
    return f"{rollouts_dir(v)}{check_worker_id(worker)}/{seq:06d}{ROLLOUT_EXT}"


def parse_rollout_key(key: str) -> tuple[int, str, int] | None:
    """(version, worker, seq) of a rollout key, None for anything else."""
    m = _ROLLOUT.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2], int(m[3])) if m else None


def worker_key(worker: str) -> str:
    return f"workers/{check_worker_id(worker)}.json"


def consumed_key(v: int) -> str:
    """The rollouts that trained version v (written before v is published)."""
    return f"trainer/consumed/{v:08d}.json"


def checkpoint_dir(v: int) -> str:
    return f"trainer/checkpoints/{v:08d}/"
