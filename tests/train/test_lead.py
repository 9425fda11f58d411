"""The lead rank's store work: what a step waits out through an outage
(each operation under its own label), and what it does not."""

import logging
import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.config import TrainerConfig
from colonnade.protocol import keys
from colonnade.protocol.documents import (
    Quarantine,
    QuarantineDecision,
    TrainerHeartbeat,
    read_signed,
)
from colonnade.protocol.signing import public_hex
from colonnade.store import LocalStore, StoreUnavailable
from colonnade.train.lead import Lead
from colonnade.train.trainer import run_spec


class Outage:
    """A store whose named methods fail as unavailable a number of times each."""

    def __init__(self, store, **failures: int):
        self.store, self.failures, self.refused = store, failures, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            if self.failures.get(name, 0) > 0:
                self.failures[name] -= 1
                self.refused.append((name, args[0] if args else None))
                raise StoreUnavailable(f"{name} refused")
            return method(*args, **kwargs)

        return call


def _lead(tmp_path, store):
    cfg = TrainerConfig(store=str(tmp_path), env="smoke", store_outage_seconds=60.0)
    private = Ed25519PrivateKey.generate()
    saved = []
    lead = Lead(cfg, store, private, "0a1b2c3d", env=None, checkpoint=saved.append)
    lead.bind(run_spec(cfg, {}, 64, public_hex(private.public_key())))
    return lead, saved


def _outage_logs(caplog) -> list[str]:
    return [r.getMessage().split(":")[0] for r in caplog.records if "unavailable" in r.message]


def test_a_steps_heartbeat_and_checkpoint_wait_out_an_outage(tmp_path, caplog):
    store = Outage(LocalStore(tmp_path), put=1)
    lead, saved = _lead(tmp_path, store)
    with caplog.at_level(logging.WARNING, logger="colonnade.trainer"):
        lead.retried.heartbeat(3)
    assert store.refused == [("put", keys.HEARTBEAT)]
    hb = read_signed(store.store, keys.HEARTBEAT, TrainerHeartbeat, lead.signer.trust)
    assert (hb.instance, hb.version) == ("0a1b2c3d", 3)
    assert _outage_logs(caplog) == ["store unavailable (heartbeat, attempt 1)"]
    lead.retried.checkpoint(4)  # the trainer's, waited on like the lead's own
    assert saved == [4]


def test_the_starting_heartbeat_does_not_wait(tmp_path):
    store = Outage(LocalStore(tmp_path), put=1)
    lead, _ = _lead(tmp_path, store)
    with pytest.raises(StoreUnavailable):
        lead.heartbeat(None)  # at start, an outage fails the trainer at once


def test_a_quarantine_is_written_through_an_outage_before_it_is_announced(tmp_path):
    store = Outage(LocalStore(tmp_path))
    lead, _ = _lead(tmp_path, store)
    lead.collector = SimpleNamespace(quarantined=set(), forged={})
    seen = []

    def judge(version, gates):
        lead.quarantine.decisions["w2"] = QuarantineDecision("kl", version, time.time())
        store.failures["put"] = 1  # quarantine.json's first write is refused
        seen.append(lead.publisher.quarantined)
        return True

    lead.quarantine.judge = judge
    lead.judge(5, {})
    assert store.refused == [("put", keys.QUARANTINE)]
    assert seen == [0] and lead.publisher.quarantined == 1
    assert lead.collector.quarantined == {"w2"}
    doc = read_signed(store.store, keys.QUARANTINE, Quarantine, lead.signer.trust)
    assert set(doc.decisions) == {"w2"}
    assert lead.guarded[keys.QUARANTINE] == store.store.get(keys.QUARANTINE)


def test_while_waiting_the_documents_are_checked_at_best(tmp_path, caplog, monkeypatch):
    store = Outage(LocalStore(tmp_path), list_times=1)
    lead, _ = _lead(tmp_path, store)
    monkeypatch.setattr("colonnade.train.lead.REPLAN_SECONDS", 0.0)
    with caplog.at_level(logging.WARNING, logger="colonnade.trainer"):
        lead.waiting(0, 0)  # the wait begins
        lead.waiting(0, 0)  # the guard meets the outage: logged, not retried, not raised
        lead.waiting(0, 0)  # and checks again at the next poll
    assert store.refused == [("list_times", keys.MODEL)]
    assert [r.getMessage() for r in caplog.records] == ["documents not checked: list_times refused"]


def test_a_proven_forgery_quarantines_its_worker_at_the_next_judgement(tmp_path):
    store = LocalStore(tmp_path)
    lead, _ = _lead(tmp_path, store)
    proof = "3 of 40 sampled tokens fall outside the intervals of their draws"
    lead.collector = SimpleNamespace(quarantined={"w3"}, forged={"w3": proof})
    lead.judge(6, {})  # no figures at all: the proof alone decides
    doc = read_signed(store, keys.QUARANTINE, Quarantine, lead.signer.trust)
    assert set(doc.decisions) == {"w3"} and doc.decisions["w3"].version == 6
    assert doc.decisions["w3"].reason == f"forged: {proof}"
    assert lead.collector.forged == {} and lead.collector.quarantined == {"w3"}
    assert lead.publisher.quarantined == 1
    lead.collector.forged = {"w3": "again"}
    lead.judge(7, {})  # a worker is quarantined once
    assert read_signed(store, keys.QUARANTINE, Quarantine, lead.signer.trust) == doc
