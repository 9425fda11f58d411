"""End-to-end async vs sync benchmark; same as `colonnade bench e2e` (see --help)."""

import sys

from colonnade.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
