"""A Prometheus endpoint (`--metrics-port`) fed by the same rows as the store.

Each process has its own registry and HTTP server. Row fields map to
metrics by name (`FIELDS`, every name a field of `protocol.metrics`'s rows,
checked at import); rates such as rollouts/s and tokens/s are left
to PromQL (`rate(colonnade_rollouts_total[1m])`), as Prometheus intends.
Every metric carries `role` and `id` labels so one dashboard covers the
trainer and every worker. The metrics the environment declares
(`colonnade.envs.metrics_of`, e.g. searchqa's `searched`) are one gauge,
`colonnade_env_metric{metric="searched"}`, fed by the trainer's
`env_metrics`: each the mean over the last step's episodes.

A process observes its own rows; a `telemetry.fleet.FleetReader` feeds it
other writers' rows read from the store, under their own role and id (the
trainer's endpoint serves every worker's figures this way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from colonnade.protocol.metrics import declared

# row field -> (metric name, kind, help)
FIELDS: dict[str, tuple[str, str, str]] = {
    "version": ("colonnade_version", "gauge", "policy version the process holds"),
    "version_skew": ("colonnade_version_skew", "gauge", "newest version minus the one held"),
    "reward_mean": ("colonnade_reward_mean", "gauge", "mean reward of the last step or batch"),
    "pass_rate": ("colonnade_pass_rate", "gauge", "share of episodes with reward 1"),
    "masked_fraction": ("colonnade_gate_masked_fraction", "gauge", "DPPO-gated token share"),
    "mismatch_kl": ("colonnade_mismatch_kl", "gauge", "rollout vs trainer policy KL (k1)"),
    "wait_fraction": ("colonnade_trainer_wait_fraction", "gauge", "share of time waiting"),
    "workers_alive": ("colonnade_workers_alive", "gauge", "workers with a fresh heartbeat"),
    "episodes": ("colonnade_rollouts_total", "counter", "episodes generated or consumed"),
    "tokens": ("colonnade_tokens_total", "counter", "tokens generated or trained on"),
    "sync_bytes": ("colonnade_sync_bytes_total", "counter", "weight bytes downloaded"),
    "patch_bytes": ("colonnade_published_bytes_total", "counter", "weight bytes published"),
    "store_errors": ("colonnade_store_errors_total", "counter", "store calls that failed"),
    "store_retries": ("colonnade_store_retries_total", "counter", "store calls retried"),
    "rejected": ("colonnade_rejected_batches_total", "counter", "batches or groups rejected"),
    "sync_seconds": ("colonnade_sync_seconds", "histogram", "time to sync to a new version"),
    "publish_blocked_seconds": (
        "colonnade_trainer_publish_blocked_seconds",
        "histogram",
        "time a step waited for the previous background publication",
    ),
    "peak_mem_mb": ("colonnade_peak_memory_mb", "gauge", "peak device (or resident) memory"),
    "paced_seconds": (
        "colonnade_worker_paced_seconds_total",
        "counter",
        "worker time idle because a step's worth of its version was already made",
    ),
}
declared(FIELDS)
(STALENESS_FIELD,) = declared(["staleness"])
(ENV_FIELD,) = declared(["env_metrics"])
ENV_METRIC = "colonnade_env_metric"
STALENESS = "colonnade_rollout_staleness"
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
MAX_ENV_METRICS = 32  # env_metrics=None: the names served, first come


class Exporter:
    """Serves /metrics on `addr`:`port` (0: pick a free one; see `.port`)."""

    def __init__(
        self, port: int, ident: str, addr: str = "127.0.0.1", env_metrics: Sequence | None = ()
    ):
        """`env_metrics`: the environment's declared metrics (`Metric`s),
        exported by name; None (a reader of a run's store, which does not load
        its environment): whatever names the trainer's signed rows carry."""
        self.registry = CollectorRegistry()
        self.env_names = None if env_metrics is None else frozenset(m.name for m in env_metrics)
        self._env_seen: set[str] = set()
        self.ident = ident
        labels = ("role", "id")
        self.metrics: dict[str, Any] = {}
        for field, (name, kind, doc) in FIELDS.items():
            if kind == "gauge":
                self.metrics[field] = Gauge(name, doc, labels, registry=self.registry)
            elif kind == "counter":
                self.metrics[field] = Counter(
                    name.removesuffix("_total"), doc, labels, registry=self.registry
                )
            else:
                self.metrics[field] = Histogram(
                    name, doc, labels, buckets=STEP_BUCKETS, registry=self.registry
                )
        self.staleness = Histogram(
            STALENESS,
            "versions between a consumed rollout and the trainer",
            labels,
            buckets=(0, 1, 2, 3, 4, 6, 8),
            registry=self.registry,
        )
        self.env_metric = Gauge(
            ENV_METRIC,
            "an environment-declared metric: its mean over the last step's episodes",
            (*labels, "metric"),
            registry=self.registry,
        )
        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port

    def observe(self, role: str, row: dict, ident: str | None = None) -> None:
        """Count `row`, a row of `role` `ident` (default: this process's id)."""
        ident = self.ident if ident is None else ident
        for field, value in row.items():
            metric = self.metrics.get(field)
            if metric is None or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            m = metric.labels(role, ident)
            kind = FIELDS[field][1]
            if kind == "gauge":
                m.set(value)
            elif kind == "counter":
                if value > 0:
                    m.inc(value)
            else:
                m.observe(value)
        for name, value in (row.get(ENV_FIELD) or {}).items():
            if self._serves_env(name) and isinstance(value, int | float):
                self.env_metric.labels(role, ident, name).set(value)
        for lag, n in (row.get(STALENESS_FIELD) or {}).items():
            for _ in range(int(n)):
                self.staleness.labels(role, ident).observe(int(lag))

    def _serves_env(self, name: str) -> bool:
        if self.env_names is not None:
            return name in self.env_names
        if name not in self._env_seen and len(self._env_seen) < MAX_ENV_METRICS:
            self._env_seen.add(name)
        return name in self._env_seen

    def forget(self, role: str, ident: str) -> None:
        """End the series of `role` `ident` (a worker gone from the store);
        rows observed later start them again."""
        for metric in (*self.metrics.values(), self.staleness):
            metric.remove(role, ident)
        names = self.env_names if self.env_names is not None else self._env_seen
        for name in list(names):
            self.env_metric.remove(role, ident, name)

    def close(self) -> None:
        self.server.shutdown()
