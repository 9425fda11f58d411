"""PULSE weight-patch benchmark; same as `colonnade bench pulse` (see --help)."""

import sys

from colonnade.bench.pulse import main

if __name__ == "__main__":
    sys.exit(main())
