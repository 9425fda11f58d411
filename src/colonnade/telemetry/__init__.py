"""Telemetry: one metrics API for every role.

`Telemetry.row(...)` records a row of figures. Rows go to the store in
append-only segments, `metrics/{role}-{id}/{segment}.jsonl` (the source of
`colonnade report`), and, when an `Exporter` is attached, to a Prometheus
endpoint.
"""

from .exporter import Exporter
from .rows import Telemetry, read_rows, read_trainer_rows, read_worker_rows

__all__ = ["Exporter", "Telemetry", "read_rows", "read_trainer_rows", "read_worker_rows"]
