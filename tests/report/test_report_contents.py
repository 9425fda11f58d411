"""The report says what a run was: its settings, sampled episodes, bytes synced."""

import json

from colonnade.protocol import keys
from colonnade.protocol.metrics import TrainerRow, WorkerRow
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


def _store(tmp_path, config):
    store = LocalStore(tmp_path)
    launch = {"started": 1e9, "status": "finished", "config": config}
    store.put(keys.LAUNCH, json.dumps(launch).encode())
    store.put(
        keys.EVAL["after"], json.dumps({"pass_at_1": 0.5, "n": 2, "samples": [SAMPLE]}).encode()
    )
    Telemetry(store, "trainer", "main", 0).write(TrainerRow(time=1e9 + 1, version=1))
    w = Telemetry(store, "worker", "w1", 0)
    for n in (1000, 234):
        w.write(WorkerRow(time=1e9, version=0, episodes=8, sync_bytes=n))
    return store


def test_the_report_holds_the_settings_samples_and_bytes_synced(tmp_path):
    config = {"": {"workers": 1}, "trainer": {"lr": 3e-4, "group_size": 8, "env_kwargs": {"a": 1}}}
    report = build_report(_store(tmp_path, config))
    assert report["config"] == config
    assert report["sync"]["worker_bytes_total"] == 1234
    page = render_html(report)
    assert "0.0003" in page and "group_size" in page and "{&quot;a&quot;: 1}" in page
    # The sampled episode, escaped: the question's tag is text, not markup.
    assert "&lt;treats&gt;" in page and "aspirin" in page and "solved" in page


def test_a_report_without_samples_or_settings_says_so(tmp_path):
    store = _store(tmp_path, {})
    store.put(keys.EVAL["after"], b'{"pass_at_1": 0.5, "n": 2}')
    page = render_html(build_report(store))
    assert "No settings recorded" in page and "No sampled episodes recorded" in page
