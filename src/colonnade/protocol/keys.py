"""Object keys of the protocol (docs/protocol.md), in two stores.

The run's store, written by the trainer only (keys relative to the run prefix):

| key                                        | writer         |
|--------------------------------------------|----------------|
| run.json                                   | trainer, once (signed) |
| model/{file}                               | trainer, once (hashed in run.json) |
| weights/{v:08d}/patch.pulse                | trainer (v ≥ 1) |
| weights/{v:08d}/full.safetensors           | trainer (anchors) |
| weights/{v:08d}/meta.json                  | trainer, last (signed) |
| weights/latest.json                        | trainer (signed) |
| trainer/heartbeat.json, keys.json, quarantine.json, done.json | trainer (signed) |
| trainer/consumed/{v:08d}-{instance}.json   | trainer (signed) |
| trainer/checkpoints/{v:08d}/...            | trainer (state.json signed) |
| metrics/trainer-main/{seg:06d}.jsonl       | trainer (signed) |
| report/launch.json, report/eval-*.json     | colonnade run  |

The inbox, written by workers (keys relative to the inbox: a bucket of its
own, or the run store's `inbox/` prefix), worker id first wherever one key
belongs to one worker, so that a per-worker prefix policy can be written:

| key                                        | writer         |
|--------------------------------------------|----------------|
| claims/{v:08d}/{slot:06d}.json             | worker (put-if-absent; signed) |
| {worker}/rollouts/{v:08d}/{seq:06d}.safetensors.zst | worker (signed) |
| {worker}/heartbeat.json                    | worker         |
| {worker}/metrics/{seg:06d}.jsonl           | worker         |
| {worker}/stages/{batch:08d}/{stream:03d}/{seq:08d}.safetensors | pipeline stage (transient) |
| {worker}/stage-link.json                   | pipeline stage on a direct link (signed) |

Claims are the one shared folder: a slot is one key that two workers race
for with put-if-absent. Every key is built, and every listed key parsed,
here: no other module spells a key or a prefix.
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
# 7: the trainer signs what workers act on; workers write only to an inbox.
# 8: tokens are drawn from public randomness: a batch names its claim slot,
#    and every token carries the probability mass below it.
# 9: a group may carry the worker's reward of each episode (an environment
#    whose episodes the trainer cannot replay: train/trust.py). An episode
#    may carry its tool service's signed replies (tools/), and ends `tool`
#    where the service gave none.
PROTOCOL_VERSION = 9
RUN = "run.json"
LATEST = "weights/latest.json"
DONE = "trainer/done.json"
HEARTBEAT = "trainer/heartbeat.json"
KEYRING = "trainer/keys.json"
QUARANTINE = "trainer/quarantine.json"
REPORT = "report/"  # written by `colonnade run`, not by the trainer
LAUNCH = "report/launch.json"
EVAL = {"before": "report/eval-before.json", "after": "report/eval-after.json"}
EVAL_DURING = "report/eval-during/"  # held-out evals while training: {v:08d}.json (launcher)
ROLLOUT_EXT = ".safetensors.zst"
WEIGHTS = "weights/"
MODEL = "model/"
TRAINER = "trainer/"
CONSUMED = "trainer/consumed/"
CHECKPOINTS = "trainer/checkpoints/"
CHECKPOINT_STATE = "state.json"  # a checkpoint's last object
TRAINER_METRICS = "metrics/trainer-main/"  # the trainer's metric segments (run store)
METRICS = "metrics/"
INBOX = "inbox/"  # the inbox's prefix in the run store, when it has no bucket of its own
# Inbox folders: the shared claims, and under each worker its own.
CLAIMS = "claims/"
ROLLOUTS = "rollouts/"
STAGES = "stages/"  # a pipeline stage's messages to the next stage (rollout/pipeline.py)
STAGE_LINK = "stage-link.json"  # where a stage takes its messages directly (rollout/stagelink.py)
MAX_STREAM = 999  # micro-batches of one pipeline batch: three digits
MAX_STEP = 99_999_999  # steps of one micro-batch: eight digits
MAX_SLOT = 999_999  # claim slots of one version: six digits
MAX_SEQ = 999_999  # a worker's batches of one version: six digits
# Not worker ids: the inbox's shared folder is named so.
RESERVED_IDS = ("claims",)

# fullmatch with explicit ASCII classes: `$` would let a trailing newline
# through, and `\d` any Unicode digit.
_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_WORKER_ID = re.compile(_ID)
_ROLLOUT = re.compile(rf"({_ID})/rollouts/([0-9]{{8}})/([0-9]{{6}})\.safetensors\.zst")
_CLAIM = re.compile(r"claims/([0-9]{8})/([0-9]{6})\.json")
_HEARTBEAT = re.compile(rf"({_ID})/heartbeat\.json")
_STAGE = re.compile(rf"({_ID})/stages/([0-9]{{8}})/([0-9]{{3}})/([0-9]{{8}})\.safetensors")
_STAGE_LINK = re.compile(rf"({_ID})/stage-link\.json")
_WORKER_METRICS = re.compile(rf"({_ID})/metrics/([0-9]{{6}})\.jsonl")
_WEIGHTS = re.compile(r"weights/([0-9]{8})/.+", re.DOTALL)
_META = re.compile(r"weights/([0-9]{8})/meta\.json")
_CONSUMED = re.compile(r"trainer/consumed/([0-9]{8})-([A-Za-z0-9]{1,64})\.json")
_INSTANCE = re.compile(r"[A-Za-z0-9]{1,64}")
_CHECKPOINT = re.compile(r"trainer/checkpoints/([0-9]{8})/(.+)")
_TRAINER_SEGMENT = re.compile(r"metrics/trainer-main/([0-9]{6})\.jsonl")


def check_worker_id(worker: str) -> str:
    if not isinstance(worker, str) or not _WORKER_ID.fullmatch(worker):
        raise ValueError(
            f"invalid worker id {worker!r}: 1-64 of letters, digits, '_', '.', '-' "
            "(starting with a letter or digit)"
        )
    if worker in RESERVED_IDS:
        raise ValueError(f"invalid worker id {worker!r}: the inbox's shared folder is named so")
    return worker


def model_file(name: str) -> str:
    return f"{MODEL}{name}"


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


def parse_weights_key(key: str) -> int | None:
    """The version of any object under `weights/{v}/`, None for anything else."""
    m = _WEIGHTS.fullmatch(key) if isinstance(key, str) else None
    return int(m[1]) if m else None


def eval_during_key(v: int) -> str:
    return f"{EVAL_DURING}{v:08d}.json"


def consumed_key(v: int, instance: str) -> str:
    """The rollouts that trained version v, by trainer `instance` (written
    before v is published; a resumed trainer is another instance and writes
    its own ledger beside one a killed one may have left)."""
    if not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
        raise ValueError(f"invalid trainer instance {instance!r}: 1-64 ASCII letters or digits")
    return f"{CONSUMED}{v:08d}-{instance}.json"


def parse_consumed_key(key: str) -> tuple[int, str] | None:
    """(version, instance) of a ledger key; None for anything else."""
    m = _CONSUMED.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2]) if m else None


def checkpoint_dir(v: int) -> str:
    return f"{CHECKPOINTS}{v:08d}/"


def checkpoint_state_key(v: int) -> str:
    """A checkpoint's state.json, written once every shard is up."""
    return checkpoint_dir(v) + CHECKPOINT_STATE


def parse_checkpoint_key(key: str) -> tuple[int, str] | None:
    """(version, file name) of a key under `trainer/checkpoints/{v}/`, None otherwise."""
    m = _CHECKPOINT.fullmatch(key) if isinstance(key, str) else None
    return (int(m[1]), m[2]) if m else None


def trainer_segment_key(segment: int) -> str:
    return f"{TRAINER_METRICS}{segment:06d}.jsonl"


def parse_trainer_segment(key: str) -> int | None:
    m = _TRAINER_SEGMENT.fullmatch(key) if isinstance(key, str) else None
    return int(m[1]) if m else None


# -- the inbox ------------------------------------------------------------------------


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


def worker_dir(worker: str) -> str:
    """Everything one worker writes but its claims: its prefix in the inbox."""
    return f"{check_worker_id(worker)}/"


def rollout_key(v: int, worker: str, seq: int) -> str:
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq {seq}: 0 to {MAX_SEQ}")
    return f"{worker_dir(worker)}{ROLLOUTS}{v:08d}/{seq:06d}{ROLLOUT_EXT}"


def parse_rollout_key(key: str) -> tuple[int, str, int] | None:
    """(version, worker, seq) of a rollout key, None for anything else."""
    m = _ROLLOUT.fullmatch(key) if isinstance(key, str) else None
    if not m or m[1] in RESERVED_IDS:
        return None
    return int(m[2]), m[1], int(m[3])


def heartbeat_key(worker: str) -> str:
    return f"{worker_dir(worker)}heartbeat.json"


def parse_heartbeat_key(key: str) -> str | None:
    """The worker of a heartbeat key, None for anything else."""
    m = _HEARTBEAT.fullmatch(key) if isinstance(key, str) else None
    return m[1] if m and m[1] not in RESERVED_IDS else None


def worker_metrics_dir(worker: str) -> str:
    return f"{worker_dir(worker)}metrics/"


def worker_segment_key(worker: str, segment: int) -> str:
    return f"{worker_metrics_dir(worker)}{segment:06d}.jsonl"


def parse_worker_segment(key: str) -> tuple[str, int] | None:
    """(worker, segment) of a worker's metric segment key, None otherwise."""
    m = _WORKER_METRICS.fullmatch(key) if isinstance(key, str) else None
    return (m[1], int(m[2])) if m and m[1] not in RESERVED_IDS else None


def stage_dir(worker: str) -> str:
    """A pipeline stage's messages, every batch's."""
    return f"{worker_dir(worker)}{STAGES}"


def stage_key(worker: str, batch: int, stream: int, seq: int) -> str:
    """Stage `worker`'s message of step `seq` of micro-batch `stream` of its
    group's batch `batch`, to the next stage (the last stage's: to the first)."""
    if not (0 <= batch <= MAX_STEP and 0 <= stream <= MAX_STREAM and 0 <= seq <= MAX_STEP):
        raise ValueError(f"stage message {batch}/{stream}/{seq}: out of range")
    return f"{stage_dir(worker)}{batch:08d}/{stream:03d}/{seq:08d}.safetensors"


def parse_stage_key(key: str) -> tuple[str, int, int, int] | None:
    """(worker, batch, stream, seq) of a stage message key, None for anything else."""
    m = _STAGE.fullmatch(key) if isinstance(key, str) else None
    if not m or m[1] in RESERVED_IDS:
        return None
    return m[1], int(m[2]), int(m[3]), int(m[4])


def stage_link_key(worker: str) -> str:
    """Stage `worker`'s address for its messages, on a direct link."""
    return f"{worker_dir(worker)}{STAGE_LINK}"


def parse_stage_link_key(key: str) -> str | None:
    """The worker of a stage address key, None for anything else."""
    m = _STAGE_LINK.fullmatch(key) if isinstance(key, str) else None
    return m[1] if m and m[1] not in RESERVED_IDS else None


def inbox_owner(key: str) -> str | None:
    """The worker a well-formed inbox key belongs to ("" for a claim, which is
    shared); None for a key that is no inbox key of ours."""
    if parse_claim_key(key) is not None:
        return ""
    if (rollout := parse_rollout_key(key)) is not None:
        return rollout[1]
    if (segment := parse_worker_segment(key)) is not None:
        return segment[0]
    if (message := parse_stage_key(key)) is not None:
        return message[0]
    if (linked := parse_stage_link_key(key)) is not None:
        return linked
    return parse_heartbeat_key(key)
