"""Telemetry: one metrics API for every role.

`Telemetry.row(...)` records a row of figures. Rows go to the store in
append-only segments (the trainer's in the run store, signed; each worker's
in its inbox folder: the source of `colonnade report`), and, when an
`Exporter` is attached, to a Prometheus endpoint. A `FleetReader` serves
other processes' rows, read from the store, on an endpoint too: the
trainer's carries every worker's, and `colonnade exporter` a whole run's.
"""

from .exporter import Exporter
from .fleet import FleetReader, follow_run
from .rows import Telemetry, read_trainer_rows, read_worker_rows, trainer_rows, worker_rows

__all__ = [
    "Exporter",
    "FleetReader",
    "Telemetry",
    "follow_run",
    "read_trainer_rows",
    "read_worker_rows",
    "trainer_rows",
    "worker_rows",
]
