"""Trainer step benchmark; same as `colonnade bench trainer` (see --help)."""

import sys

from colonnade.bench.trainer import main

if __name__ == "__main__":
    sys.exit(main())
