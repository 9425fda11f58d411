"""`python -m colonnade …`: the same command line as `colonnade …`, for launchers
that start modules (`torchrun --nproc-per-node N -m colonnade trainer …`)."""

import sys

from colonnade.cli.main import main

sys.exit(main())
