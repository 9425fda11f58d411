"""An environment declares the metrics shown beside reward and pass@1."""

from typing import ClassVar

import pytest

from colonnade.envs import Metric, Score, Task, load_environment, metrics_of, success_of
from colonnade.envs.smoke import Smoke
from colonnade.rollout.episodes import Result
from colonnade.rollout.evaluate import summarize
from colonnade.train.step import env_metric_means
from colonnade.train.warmstart import WarmstartConfig, env_defaults


class Custom(Smoke):
    """A whole environment (smoke's tasks) that declares its own metrics."""

    name = "custom-metrics-env"
    metrics = (Metric("hops", "tool hops", report="hop_rate"), "tidy")
    warmstart_defaults: ClassVar = {"tiny": {"steps": 11, "good_fraction": 0.5}}


def _custom():
    return Custom(10, 0)


def test_metrics_of_reads_the_declaration():
    assert metrics_of(_custom()) == (Metric("hops", "tool hops", "hop_rate"), Metric("tidy"))
    assert [m.title for m in metrics_of(_custom())] == ["tool hops", "tidy"]
    assert metrics_of(object()) == ()  # declares none: nothing beyond reward and pass@1


def test_builtins_declare_theirs_and_only_searchqa_names_search():
    searchqa = metrics_of(load_environment("searchqa", n_clusters=20))
    assert [m.name for m in searchqa] == ["searched", "search_success"]
    assert searchqa[0].key == "search_rate"
    smoke = metrics_of(load_environment("smoke"))
    assert smoke and not any("search" in m.name or "search" in m.title for m in smoke)


def test_eval_reports_a_custom_metric_under_its_declared_name():
    task = Task("t", "q", ("a",))
    results = [Result(task, None, Score(1.0, {"correct": 1.0, "hops": 2.0, "tidy": 1.0}))]
    out = summarize(results, success_of(_custom()), 1, metrics_of(_custom()))
    assert out["hop_rate"] == 2.0 and out["tidy"] == 1.0 and "hops" not in out


def test_step_means_of_the_episodes_metrics():
    got = env_metric_means([{"hops": 1.0, "tidy": 0.0}, {"hops": 3.0}, {"bad": float("nan")}])
    assert got == {"hops": 2.0, "tidy": 0.0}


def test_warmstart_defaults_are_the_environments(monkeypatch):
    import sys
    import types

    module = types.ModuleType("custom_metrics_env")
    module.load_environment = _custom
    monkeypatch.setitem(sys.modules, "custom_metrics_env", module)
    assert env_defaults("tiny", "custom_metrics_env") == {"steps": 11, "good_fraction": 0.5}
    assert env_defaults("smollm2-135m", "custom_metrics_env") == {}
    cfg = WarmstartConfig(model="tiny", env="custom_metrics_env").resolved()
    assert (cfg.steps, cfg.good_fraction) == (11, 0.5)
    # searchqa's values as they were when keyed by (model, "searchqa") in warmstart.py
    tiny = WarmstartConfig(model="tiny", env="searchqa").resolved()
    assert (tiny.drill_steps, tiny.steps, tiny.skill_fraction, tiny.mix_lr) == (
        150, 1000, 0.8, 3e-4)  # fmt: skip
    smol = WarmstartConfig(model="smollm2-135m", env="searchqa").resolved()
    assert (smol.good_fraction, smol.skill_fraction, smol.mix_lr) == (0.25, 0.3, 6e-5)
    assert env_defaults("tiny", "smoke") == {}


def test_a_declared_default_must_be_a_warmstart_field(monkeypatch):
    import sys
    import types

    class Wrong(Custom):
        warmstart_defaults: ClassVar = {"tiny": {"stepz": 3}}

    module = types.ModuleType("wrong_warm_env")
    module.load_environment = lambda: Wrong(10, 0)
    monkeypatch.setitem(sys.modules, "wrong_warm_env", module)
    with pytest.raises(ValueError, match="stepz"):
        env_defaults("tiny", "wrong_warm_env")


def test_prometheus_and_the_report_show_the_declared_metrics(tmp_path, signed_run):
    import urllib.request

    from colonnade.protocol import keys
    from colonnade.protocol.metrics import TrainerRow
    from colonnade.report import build_report
    from colonnade.report.html import render_html
    from colonnade.store import LocalStore
    from colonnade.telemetry import Exporter, Telemetry

    store = LocalStore(tmp_path)
    signer = signed_run(store, env="custom-metrics-env")
    ex = Exporter(0, "main", env_metrics=metrics_of(_custom()))
    try:
        t = Telemetry.for_trainer(store, signer, 0, ex)
        for v in (1, 2):
            t.write(TrainerRow(time=1e9 + v, version=v, env_metrics={"hops": 0.5 * v}))
        t.row(version=3, env_metrics={"undeclared": 1.0})
        text = urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=5).read()
    finally:
        ex.close()
    text = text.decode()
    store.put(keys.LAUNCH, b'{"started": 999999999.0, "status": "finished"}')
    assert 'colonnade_env_metric{id="main",metric="hops",role="trainer"} 1.0' in text
    assert "undeclared" not in text
    report = build_report(store)
    assert report["series"]["env_metrics"]["hops"] == [0.5, 1.0, None]
    assert "<html" in render_html(report).lower()
