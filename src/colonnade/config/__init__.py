"""Every role's typed settings, their presets, and how they are loaded.

Light: importing this package imports neither torch nor transformers, so
`colonnade config show`, `--help` and a config check start at once.
"""

from .flags import add_flags, flag_values
from .loading import help_of, load_config, setting
from .presets import RUN_PRESETS, TRAINER_PRESETS
from .run import RunConfig
from .trainer import TrainerConfig
from .worker import WorkerConfig

__all__ = [
    "RUN_PRESETS",
    "TRAINER_PRESETS",
    "RunConfig",
    "TrainerConfig",
    "WorkerConfig",
    "add_flags",
    "flag_values",
    "help_of",
    "load_config",
    "setting",
]
