"""The report says what a run was: its settings, sampled episodes, bytes synced."""

import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import keys
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import SignatureRejected, Signer
from colonnade.report import build_report
from colonnade.report.html import render_html
from colonnade.store import LocalStore
from colonnade.telemetry import Telemetry

SAMPLE = {
    "task": "t7",
    "question": "Which drug <treats> X?",
    "completion": "<search>X</search> ... <answer>aspirin</answer>",
    "reward": 1.0,
    "solved": True,
    "finish": "done",
}


def _store(tmp_path, config, signed_run):
    store = LocalStore(tmp_path)
    signer = signed_run(store)
    launch = {"started": 1e9, "status": "finished", "config": config}
    store.put(keys.LAUNCH, json.dumps(launch).encode())
    store.put(
        keys.EVAL["after"], json.dumps({"pass_at_1": 0.5, "n": 2, "samples": [SAMPLE]}).encode()
    )
    Telemetry.for_trainer(store, signer, 0).write(TrainerRow(time=1e9 + 1, version=1))
    w = Telemetry.for_worker(store.sub(keys.INBOX), "w1", 0)
    for n in (1000, 234):
        w.write(WorkerRow(time=1e9, version=0, episodes=8, sync_bytes=n))
    return store


def test_the_report_holds_the_settings_samples_and_bytes_synced(tmp_path, signed_run):
    config = {"": {"workers": 1}, "trainer": {"lr": 3e-4, "group_size": 8, "env_kwargs": {"a": 1}}}
    store = _store(tmp_path, config, signed_run)
    report = build_report(store)
    assert report["config"] == config
    assert report["sync"]["worker_bytes_total"] == 1234
    assert report["series"]["version"] == [1]
    fp = open_run(store).trust.fingerprint
    assert report["trainer_key"] == fp and build_report(store, fp)["trainer_key"] == fp
    with pytest.raises(SignatureRejected, match="wrong_key"):  # pinned to another trainer
        build_report(store, Signer(Ed25519PrivateKey.generate(), "r1").trust.fingerprint)
    page = render_html(report)
    assert "0.0003" in page and "group_size" in page and "{&quot;a&quot;: 1}" in page
    # The sampled episode, escaped: the question's tag is text, not markup.
    assert "&lt;treats&gt;" in page and "aspirin" in page and "solved" in page


def test_a_report_without_samples_or_settings_says_so(tmp_path, signed_run):
    # The launcher stopped before the trainer made the run: no run.json either.
    store = LocalStore(tmp_path / "early")
    store.put(keys.LAUNCH, json.dumps({"started": 1e9, "status": "failed", "config": {}}).encode())
    store.put(keys.EVAL["after"], b'{"pass_at_1": 0.5, "n": 2}')
    report = build_report(store)
    assert report["run_id"] is None and report["trainer_key"] is None
    page = render_html(report)
    assert "No settings recorded" in page and "No sampled episodes recorded" in page
    # Without the launcher's settings, a run's report shows what its signed run.json says.
    store = _store(tmp_path / "run", {}, signed_run)
    report = build_report(store)
    assert report["config"]["run.json"]["env"] == "smoke" and report["run_id"] == "r1"
    assert "No settings recorded" not in render_html(report)
