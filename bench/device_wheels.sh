#!/usr/bin/env bash
# Wheels that the lent GPU machine's image (Python 3.12, torch, transformers, numba,
# safetensors, rich, prometheus-client, matplotlib: there) lacks, for
# bench/device_check.sh; run here, where pip reaches PyPI. They go to .whl/,
# which git ignores and the device run carries (about 28 MB). SmolLM2's own
# package (93 MB) is too large to travel: there the bench trains a model of
# SmolLM2-135M's shape from its config, randomly initialised.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for pkg in zstandard boto3 botocore s3transfer jmespath bm25s cryptography cffi; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$pkg"
done
du -sh .whl
