"""`colonnade run`: warm start, eval, 1 trainer + N workers as processes, report.

The launcher is only a convenience on one machine: the trainer and workers
it starts are the same `colonnade trainer` / `colonnade worker` processes a
user starts by hand across machines, joined only by the store.
"""

from .config import resolve_run_config, role_configs

__all__ = ["resolve_run_config", "role_configs"]
