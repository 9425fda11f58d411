"""What a fleet's traffic would cost: list prices of R2 and S3, and a cost model
that scales one run's per-worker requests and patch sizes to a 4B model.

Called by `cli.run` on the summary from `analysis.summarize`; the store
verbs counted by `wan.WanStore` are mapped to the providers' billing classes
here. The prices and what they gave are in docs/benchmarks.md.
"""

from __future__ import annotations

import math

from .options import FleetOptions

# Request and storage prices for the cost model: list prices as published on
# the providers' pricing pages in 2024-2025 (R2: Cloudflare R2 pricing; S3:
# S3 Standard, us-east-1), not re-checked when this was written (2026-12).
PRICES = {
    "r2": {"class_a": 4.50e-6, "class_b": 0.36e-6, "egress_gb": 0.0, "storage_gb_month": 0.015},
    "s3": {"class_a": 0.005e-3, "class_b": 0.0004e-3, "egress_gb": 0.09,
           "storage_gb_month": 0.023},
}  # fmt: skip
PRICES_AS_OF = "list prices published 2024-2025, not re-checked 2026-12"
CLASS_A = ("put", "put_if_absent", "put_file", "list")  # writes and listings
CLASS_B = ("get", "size", "get_file")  # reads and HEADs (deletes are free on both)

GB = 1e9
PARAMS_4B = 4e9
# bytes per parameter: int8 published weights (what workers download; the row
# scales are ~0.1%), and a checkpoint (fp32 master weights + two Adam moments).
INT8_BYTES, CKPT_BYTES = 1.0, 12.0
# The int8 patch of a real model at a real rate, as a fraction of its int8
# state: SmolLM2-135M at lr 1e-5 in the PULSE table of docs/benchmarks.md
# (int8 patch bytes over half the bf16 full bytes). The tiny model at the
# smoke preset's 3e-4 changes far more of its codes per step.
SMOLLM2_PATCH_FRACTION = 44_327 / (269_060_520 / 2)


def cost_model(s: dict, opts: FleetOptions, workers: int = 100, versions: int = 1000,
               version_seconds: float = 60.0, keep_checkpoints: int = 2,
               checkpoint_every: int = 5, part_bytes: float = 64 * 2**20,
               patch_fraction: float | None = None) -> dict:  # fmt: skip
    """Dollars per `versions` versions for a 4B model and `workers` workers,
    from this run's per-worker requests and its patch fraction (patch bytes
    over the full int8 state), scaled to 4B parameters.

    Requests: the workers' measured steady-state verbs; the trainer's measured
    ones plus the multipart parts a 4B anchor and checkpoint take (the tiny
    model's fit in one PUT). Egress: each worker's patch per version plus the
    small documents it read (measured bytes less the tiny patch). Storage:
    what retention keeps (two anchors, two anchor windows of patches, the
    kept checkpoints) for the run's duration at `version_seconds` a version.
    `patch_fraction` replaces the measured one (e.g. SMOLLM2_PATCH_FRACTION).
    """
    full = PARAMS_4B * INT8_BYTES
    fraction = s["patch_bytes_mean"] / s["full_bytes"] if s["full_bytes"] else 0.0
    if patch_fraction is not None:
        fraction = patch_fraction
    patch = fraction * full
    docs = max(0.0, s["down_bytes_per_worker_per_version"] - s["patch_bytes_mean"])
    w = s["requests_per_worker_per_version_by_verb"]
    t = s["trainer_requests_per_version_by_verb"]
    ckpt_parts = math.ceil(PARAMS_4B * CKPT_BYTES / part_bytes) + 2  # + create, complete
    anchor_parts = math.ceil(full / part_bytes) + 2
    extra_a = ckpt_parts / checkpoint_every + anchor_parts / opts.anchor_every
    class_a = versions * (workers * sum(w.get(v, 0) for v in CLASS_A)
                          + sum(t.get(v, 0) for v in CLASS_A) + extra_a)  # fmt: skip
    class_b = versions * (workers * sum(w.get(v, 0) for v in CLASS_B)
                          + sum(t.get(v, 0) for v in CLASS_B))  # fmt: skip
    egress_gb = versions * workers * (patch + docs) / GB
    kept_gb = (2 * full + 2 * opts.anchor_every * patch
               + keep_checkpoints * PARAMS_4B * CKPT_BYTES) / GB  # fmt: skip
    months = versions * version_seconds / (30 * 86400)
    out = {
        "assumptions": {
            "params": PARAMS_4B, "workers": workers, "versions": versions,
            "version_seconds": version_seconds, "patch_fraction": round(fraction, 5),
            "patch_bytes_4b": round(patch), "prices": PRICES_AS_OF,
        },
        "class_a_requests": round(class_a), "class_b_requests": round(class_b),
        "egress_gb": round(egress_gb, 1), "stored_gb": round(kept_gb, 1),
    }  # fmt: skip
    for name, p in PRICES.items():
        parts = {
            "class_a": class_a * p["class_a"],
            "class_b": class_b * p["class_b"],
            "egress": egress_gb * p["egress_gb"],
            "storage": kept_gb * months * p["storage_gb_month"],
        }
        out[name] = {k: round(v, 2) for k, v in parts.items()} | {
            "total": round(sum(parts.values()), 2)
        }
    return out
