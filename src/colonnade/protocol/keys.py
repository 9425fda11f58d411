"""Object keys of protocol v5, all relative to the run prefix (docs/protocol.md).

| key                                        | writer         |
|--------------------------------------------|----------------|
| run.json                                   | trainer, once  |
| model/{file}                               | trainer, once  |
| weights/{v:08d}/patch.pulse                | trainer (v ≥ 1) |
| weights/{v:08d}/full.safetensors           | trainer (anchors) |
| weights/{v:08d}/meta.json                  | trainer, last  |
| weights/latest.json                        | trainer (hint) |
| rollouts/{v:08d}/{worker}/{seq:06d}.safetensors.zst | worker |
| claims/{v:08d}/{slot:06d}.json             | worker (put-if-absent) |
| workers/{worker}.json                      | worker         |
| trainer/heartbeat.json, keys.json, quarantine.json, done.json | trainer |
| trainer/consumed/{v:08d}-{instance}.json   | trainer        |
| trainer/checkpoints/{v:08d}/...            | trainer        |
| metrics/{role}-{id}/{seg:06d}.jsonl        | each process   |
| report/launch.json, report/eval-*.json     | colonnade run  |

Every key is built, and every listed key parsed, here: no other module
spells a key or a prefix.
"""

from __future__ import annotations

import re

# 2: hashes name their algorithm (BLAKE3 tree hashes by default), PULSE format 2.
# 3: rollout batches are binary: zstd over safetensors (int32 ids, float32 log-probs).
# 4: demand-driven generation: latest.json carries the trainer's demand; a worker
#    claims a slot (claims/{v}/{slot}.json) before it makes a batch.
# 5: latest.json carries the trainer's seconds per version, so that a joiner
#    polls at the pace of the versions from its first look.
# 6: patches are PULSE format 3 (an inverted rice group states its class size).
PROTOCOL_VERSION = 6
RUN = "run.json"
LATEST = "weights/latest.json"
DONE = "trainer/done.json"
HEARTBEAT = "trainer/heartbeat.json"
KEYRING = "trainer/keys.json"
QUARANTINE = "trainer/quarantine.json"
LAUNCH = "report/launch.json"
EVAL = {"before": "report/eval-before.json", "after": "report/eval-after.json"}
EVAL_DURING = "report/eval-during/"  # held-out evals while training: {v:08d}.json (launcher)
ROLLOUT_EXT = ".safetensors.zst"
# Prefixes a process lists (and the trainer cleans of partial uploads).
WEIGHTS = "weights/"
ROLLOUTS = "rollouts/"
CLAIMS = "claims/"
WORKERS = "workers/"
TRAINER = "trainer/"
CONSUMED = "trainer/consumed/"
CHECKPOINTS = "trainer/checkpoints/"
CHECKPOINT_STATE = "state.json"  # a checkpoint's last object
MAX_SLOT = 999_999  # claim slots of one version: six digits
METRICS = "metrics/"

# fullmatch with explicit ASCII classes: `$` would let a trailing newline
# through, and `\d` any Unicode digit.
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ROLLOUT = re.compile(
    r"rollouts/([0-9]{8})/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})/([0-9]{6})\.safetensors\.zst"
)
_VERSION_DIR = re.compile(r"(weights|rollouts|claims)/([0-9]{8})/.+", re.DOTALL)
_CLAIM = re.compile(r"claims/([0-9]{8})/([0-9]{6})\.json")
_META = re.compile(r"weights/([0-9]{8})/meta\.json")
_WORKER = re.compile(r"workers/([A-Za-z0-9][A-Za-z0-9_.-]{0,63})\.json")
# Ledgers of earlier releases have no instance.
_CONSUMED = re.compile(r"trainer/consumed/([0-9]{8})(?:-([A-Za-z0-9]{1,64}))?\.json")
_INSTANCE = re.compile(r"[A-Za-z0-9]{1,64}")
_CHECKPOINT = re.compile(r"trainer/checkpoints/([0-9]{8})/(.+)")
_ROLE = re.compile(r"[a-z]{1,16}")
# metrics/{role}-{id}/{seg}.jsonl, or one metrics/{role}-{id}.jsonl of earlier releases
_METRICS = re.compile(
    r"metrics/([a-z]{1,16})-([A-Za-z0-9][A-Za-z0-9_.-]{0,63})(?:/([0-9]{6}))?\.jsonl"
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


def parse_meta_key(key: str) -> int | None:
    """The version of a `weights/{v}/meta.json` key, None for anything else."""
    m = _META.fullmatch(key) if isinstance(key, str) else None
    return int(m[1]) if m else None


def parse_version_dir(key: str) -> tuple[str, int] | None:
    """("weights" | "rollouts" | "claims", v) of any object under `weights/{v}/`,
    `rollouts/{v}/` or `claims/{v}/` (well-formed or not), None for anything else."""
    m = _VERSION_DIR.fullmatch(key) if isinstance(key, str) else None
    return (m[1], int(m[2])) if m else None


def rollouts_dir(v: int) -> str:
    return f"rollouts/{v:08d}/"


def rollout_key(v: int, worker: str, seq: int) -> str:
    return f"{rollouts_dir(v)}{check_worker_id(worker)}/{seq:06d}{ROLLOUT_EXT}"


def parse_rollout_key(key: str) -> tuple[int, str, int] | None:
    """(version, worker, seq) of a rollout key, None for anything else."""
    m = _ROLLOUT.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2], int(m[3])) if m else None


def eval_during_key(v: int) -> str:
    return f"{EVAL_DURING}{v:08d}.json"


def claims_dir(v: int) -> str:
    return f"{CLAIMS}{v:08d}/"


def claim_key(v: int, slot: int) -> str:
    """Slot `slot` of version v: the worker that writes it first (put-if-absent)
    makes that batch (docs/protocol.md, "Demand and claims")."""
    if not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot {slot}: 0 to {MAX_SLOT}")
    return f"{claims_dir(v)}{slot:06d}.json"


def parse_claim_key(key: str) -> tuple[int, int] | None:
    """(version, slot) of a claim key, None for anything else."""
    m = _CLAIM.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), int(m[2])) if m else None


def worker_key(worker: str) -> str:
    return f"{WORKERS}{check_worker_id(worker)}.json"


def parse_worker_key(key: str) -> str | None:
    """The worker of a heartbeat key `workers/{worker}.json`, None for anything else."""
    m = _WORKER.fullmatch(key) if isinstance(key, str) else None
    return m[1] if m else None


def consumed_key(v: int, instance: str) -> str:
    """The rollouts that trained version v, by trainer `instance` (written
    before v is published; a resumed trainer is another instance and writes
    its own ledger beside one a killed one may have left)."""
    if not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
        raise ValueError(f"invalid trainer instance {instance!r}: 1-64 ASCII letters or digits")
    return f"{CONSUMED}{v:08d}-{instance}.json"


def parse_consumed_key(key: str) -> tuple[int, str] | None:
    """(version, instance) of a ledger key; instance "" for a ledger of an
    earlier release (`{v:08d}.json`); None for anything else."""
    m = _CONSUMED.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2] or "") if m else None


def checkpoint_dir(v: int) -> str:
    return f"{CHECKPOINTS}{v:08d}/"


def checkpoint_state_key(v: int) -> str:
    """A checkpoint's state.json, written once every shard is up."""
    return checkpoint_dir(v) + CHECKPOINT_STATE


def parse_checkpoint_key(key: str) -> tuple[int, str] | None:
    """(version, file name) of a key under `trainer/checkpoints/{v}/`, None otherwise."""
    m = _CHECKPOINT.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2]) if m else None


def metrics_dir(role: str, ident: str) -> str:
    """The folder of one process's metric segments."""
    if not isinstance(role, str) or not _ROLE.fullmatch(role):
        raise ValueError(f"invalid role {role!r}: 1-16 lowercase letters")
    return f"{METRICS}{role}-{check_worker_id(ident)}/"


def metrics_key(role: str, ident: str, segment: int) -> str:
    return f"{metrics_dir(role, ident)}{segment:06d}.jsonl"


def parse_metrics_key(key: str) -> tuple[str, str, int] | None:
    """(role, id, segment) of a metric segment key; segment -1 for the
    whole-file `metrics/{role}-{id}.jsonl` of earlier releases; None otherwise."""
    m = _METRICS.fullmatch(key) if isinstance(key, str) else None
    return (m[1], m[2], int(m[3]) if m[3] else -1) if m else None
