"""Rollout throughput benchmark; same as `colonnade bench rollout` (see --help)."""

import sys

from colonnade.bench.rollout import main

if __name__ == "__main__":
    sys.exit(main())
