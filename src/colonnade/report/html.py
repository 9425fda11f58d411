"""report.html: one self-contained page, matplotlib PNGs inlined as base64."""

from __future__ import annotations

import base64
import html
import io
import json

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _learning(series: dict, x: str, label: str, held_out: list[dict] = ()) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(series[x], series["reward_mean"], label="reward (train)")
    ax.plot(series[x], series["pass_rate"], label="pass rate (train)")
    points = [(e["version"], e["pass_at_1"]) for e in held_out if "pass_at_1" in e]
    if points:
        ax.plot(*zip(*points, strict=True), marker="o", label="pass@1 (held out)")
    # what the environment declares (the trainer's rows carry those only)
    for name, values in (series.get("env_metrics") or {}).items():
        points = [(a, b) for a, b in zip(series[x], values, strict=False) if b is not None]
        if points:
            ax.plot(*zip(*points, strict=True), label=f"{name} (train)", linestyle="--")
    ax.set_xlabel(label)
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def _staleness(stale: dict) -> str:
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ks = sorted(int(k) for k in stale)
    ax.bar([str(k) for k in ks], [stale[str(k)] for k in ks])
    ax.set_xlabel("versions behind the trainer")
    ax.set_ylabel("groups trained on")
    return _png(fig)


def _gate(series: dict) -> str:
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(series["version"], series["masked_fraction"], label="masked fraction")
    ax.plot(series["version"], series["mismatch_kl"], label="mismatch KL")
    ax.set_xlabel("version")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def _bytes(versions: list[dict]) -> str:
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.semilogy(
        [v["version"] for v in versions],
        [max(1, v["bytes"]) for v in versions],
        "o-",
        label="published payload",
    )
    ax.semilogy(
        [v["version"] for v in versions],
        [v["full_bytes"] for v in versions],
        "--",
        label="full state (int8)",
    )
    ax.set_xlabel("version")
    ax.set_ylabel("bytes")
    ax.legend()
    return _png(fig)


def _workers(workers: dict) -> str:
    fig, ax = plt.subplots(figsize=(4.5, 3))
    names = sorted(workers)
    ax.bar(names, [workers[n]["episodes_per_s"] for n in names])
    ax.set_ylabel("episodes / s (busy time)")
    return _png(fig)


def _eval_table(ev: dict) -> str:
    """pass@1 first, then every figure the environment reported, n last; the rule below."""
    before, after = ev.get("before") or {}, ev.get("after") or {}
    skip = {"pass_at_1", "n", "temperature", "version"}
    figures = [
        k
        for k in dict.fromkeys([*before, *after])
        if k not in skip and isinstance(before.get(k, after.get(k)), int | float)
    ]
    keys = [k for k in ("pass_at_1", *figures, "n") if k in before or k in after]
    if not keys:
        return "<p>No held-out evaluation in this run.</p>"
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = "".join(
        f"<tr><td>{name}</td>"
        + "".join(f"<td>{html.escape(str(d.get(k, '')))}</td>" for k in keys)
        + "</tr>"
        for name, d in (("before", before), ("after", after))
    )
    rule = after.get("success") or before.get("success")
    note = f"<p>pass@1 counts {html.escape(str(rule))}.</p>" if rule else ""
    return f"<table><tr><th></th>{head}</tr>{rows}</table>{note}"


# The settings a reader looks for first; the full tables follow them.
KEY_SETTINGS = ("env_kwargs", "lr", "group_size", "groups_per_step", "max_lag", "max_versions")


def _settings(config: dict) -> str:
    """The run's settings: the key ones in a table, then every table in full."""
    if not config:
        return "<p>No settings recorded.</p>"
    trainer = config.get("trainer") or config.get("run.json") or {}
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(trainer[k]))}</td></tr>"
        for k in KEY_SETTINGS
        if k in trainer
    )
    full = html.escape(json.dumps(config, indent=1, sort_keys=True))
    return (
        f"<table>{rows}</table><details><summary>all settings</summary><pre>{full}</pre></details>"
    )


def _samples(ev: dict) -> str:
    """Sampled held-out episodes of the last evaluation (after, else before)."""
    which = "after" if (ev.get("after") or {}).get("samples") else "before"
    samples = (ev.get(which) or {}).get("samples") or []
    if not samples:
        return "<p>No sampled episodes recorded.</p>"
    items = "".join(
        f"<h4>{html.escape(str(x['task']))}: reward {x['reward']:g}, "
        f"{'solved' if x['solved'] else 'not solved'} ({html.escape(str(x['finish']))})</h4>"
        f"<p>{html.escape(str(x['question']))}</p><pre>{html.escape(str(x['completion']))}</pre>"
        for x in samples
    )
    return f"<p>From the held-out evaluation {which} training.</p>{items}"


def render_html(report: dict) -> str:
    """The page for a report dict from `build_report`."""
    s = report["series"]
    figures = []
    if s["version"]:
        figures += [
            (
                "Reward and pass rate by version",
                _learning(s, "version", "version", report["eval"].get("during") or []),
            ),
            ("Reward and pass rate by wall time", _learning(s, "wall_s", "seconds")),
            ("DPPO gate", _gate(s)),
        ]
    if report["staleness"]:
        figures.append(("Staleness of trained rollouts", _staleness(report["staleness"])))
    if report["versions"]:
        figures.append(("Weight sync: patch against full bytes", _bytes(report["versions"])))
    if report["workers"]:
        figures.append(("Per-worker throughput", _workers(report["workers"])))
    headline = {
        k: report[k]
        for k in (
            "env",
            "model",
            "status",
            "versions_published",
            "rollouts_consumed",
            "rollouts_dropped_stale",
            "rollouts_rejected",
            "wall_s",
            "trainer_wait_fraction",
            "trainer_publish_blocked_fraction",
        )
    }
    headline["gate masked fraction"] = report["gate"]["masked_fraction"]
    headline["full bytes"] = report["sync"]["full_bytes"]
    headline["patch bytes (median)"] = report["sync"]["patch_bytes_median"]
    headline["weight bytes synced (all workers)"] = report["sync"].get("worker_bytes_total")
    headline["rollouts unused"] = report.get("rollouts_unused")
    headline["episodes ended by a tool reply past the budget"] = report.get("episodes_overflow", 0)
    headline["waste fraction"] = report.get("waste_fraction")
    rewards = report.get("rewards") or {}
    if rewards.get("trusted"):  # an environment the trainer cannot always rescore
        headline["rewards recomputed / trusted (share)"] = (
            f"{rewards['recomputed_share']:.1%} / {rewards['trusted_share']:.1%}"
        )
    facts = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in headline.items()
    )
    imgs = "".join(
        f'<h3>{t}</h3><img alt="{t}" src="data:image/png;base64,{b}">' for t, b in figures
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>colonnade run {html.escape(str(report['run_id']))}</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "td,th{padding:2px 10px;text-align:left}</style></head><body>"
        f"<h1>colonnade run {html.escape(str(report['run_id']))}</h1>"
        f"<h2>Held-out evaluation</h2>{_eval_table(report['eval'])}"
        f"<h2>Run</h2><table>{facts}</table>"
        f"<h2>Settings</h2>{_settings(report.get('config') or {})}"
        f"<h2>Sample completions</h2>{_samples(report['eval'])}{imgs}</body></html>"
    )
