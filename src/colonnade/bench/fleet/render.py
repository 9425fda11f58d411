"""The text `colonnade bench fleet` prints: the per-version table from
`analysis.per_version`, then one line each for the steady state, waste and
wait, the store's objects, the joiner, the baseline, the cost model and the
targets, all read from the summary `cli.run` assembled."""

from __future__ import annotations


def render(table: list[dict], s: dict) -> str:
    """The per-version table, then the totals, the joiner, the cost model."""
    lines = [
        f"{'v':>4}{'workers':>8}{'req/w':>7}{'get':>6}{'list':>6}{'put':>6}{'down/w B':>10}"
        f"{'anch':>5}{'made':>6}{'used':>6}{'wait s':>8}{'step s':>8}{'objects':>8}{'MB':>7}"
    ]
    for r in table:
        b = r["by_verb"]
        puts = b.get("put", 0) + b.get("put_if_absent", 0) + b.get("put_file", 0)
        lines.append(
            f"{r['version']:>4}{r['workers']:>8}{r['requests_per_worker']:>7.2f}"
            f"{b.get('get', 0) + b.get('get_file', 0) + b.get('size', 0):>6.2f}"
            f"{b.get('list', 0):>6.2f}{puts:>6.2f}{r['down_per_worker']:>10}"
            f"{r['follower_anchor_downloads']:>5}{r['groups_made']:>6}{r['groups_trained']:>6}"
            f"{_num(r['trainer_wait_s']):>8}{_num(r['trainer_step_s']):>8}{r['objects']:>8}"
            f"{r['store_bytes'] / 1e6:>7.1f}"
        )
    verbs = ", ".join(f"{v} {n}" for v, n in s["requests_per_worker_per_version_by_verb"].items())
    lines += [
        f"steady state (v{s['warmup_versions']}..v{s['versions']}): "
        f"{s['requests_per_worker_per_version']} requests per worker per version ({verbs}; "
        f"latest.json polls {s['latest_polls_per_worker_per_version']}); "
        f"{s['down_bytes_per_worker_per_version']} B down per worker per version",
        f"follower anchor downloads {s['follower_anchor_downloads']}; waste "
        f"{100 * s['waste_fraction']:.1f}% ({s['groups_trained']} of {s['groups_uploaded']} "
        f"groups trained; {100 * s['waste_fraction_closed_windows']:.1f}% over closed windows); "
        f"trainer wait {100 * s['trainer_wait_fraction']:.1f}% "
        f"(all {100 * s['trainer_wait_fraction_all']:.1f}%)",
        f"objects after warm-up {s['objects_after_warmup']}, peak {s['objects_peak']}, end "
        f"{s['objects_end']} ({s['store_bytes_end'] / 1e6:.1f} MB): {s['objects_end_by_prefix']}",
        f"joiner at v{s['joiner']['version']}: {s['joiner_bytes']} B in {s['joiner_seconds']} s "
        f"({s['joiner_weight_bytes']} B of weights: {s['joiner']['anchors']} anchor + "
        f"{s['joiner']['patches']} patches); any version: <= "
        f"{s['joiner_bound']['anchor_plus_patches_worst_bytes']} B of weights",
    ]
    if "baseline" in s:
        b = s["baseline"]
        lines.append(
            f"trainer wait: {100 * s['trainer_wait_fraction']:.1f}% with {s['workers']} workers, "
            f"{100 * b['trainer_wait_fraction']:.1f}% with {b['workers']}"
        )
    c, r = s["cost_per_1000_versions"], s["cost_per_1000_versions_smollm2_patch"]
    lines.append(
        f"cost per 1,000 versions, 4B model, 100 workers: R2 ${c['r2']['total']}, "
        f"S3 ${c['s3']['total']} with this run's patch fraction "
        f"({c['assumptions']['patch_fraction']}); R2 ${r['r2']['total']}, S3 "
        f"${r['s3']['total']} with SmolLM2's at lr 1e-5 ({c['assumptions']['prices']})"
    )
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                         for k, v in s["targets"].items()))  # fmt: skip
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
