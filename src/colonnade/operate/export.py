"""A published version taken out of a run's store: an ordinary Hugging Face model folder.

`colonnade export STORE[@vN] -o DIR` and the end of `colonnade run` (its
`final-model`) call `export_version`; `colonnade eval --model STORE@vN` and
the run's own evaluations rebuild a version with `rebuild` too
(`launch.evaluation.version_engine`). A version is rebuilt exactly as a
worker rebuilds it, with the worker's own parts: run.json verified and the
trainer's key pinned (`protocol.reader.open_run`), the model files checked
against the hashes it signed (`fetch_files`), the weights from the newest
anchor at or below the version plus the PULSE patches after it, each
checked against its signed meta.json (`Follower`). Nothing here decodes or
trusts anything on its own.

The folder holds config.json, the tokenizer and the generation config as the
trainer published them, and model.safetensors: the weights the workers run
(int8 codes and row scales, or bf16, as the run publishes), dequantized to
the dtype config.json names (bf16 where it names none), LoRA adapters merged
into the weights they adapt. `adapter=True` writes instead the adapters
alone as PEFT saves them (adapter_model.safetensors under PEFT's names,
adapter_config.json with lora_alpha = r: the published B' holds the
scale), for a version whose state carries adapters. It is written into
a sibling `DIR.tmp-…` and renamed into place, so a crash never leaves a
half-written folder at DIR.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import save_file

from colonnade.protocol import Follower, keys, latest_version, read_meta
from colonnade.protocol.model_files import fetch_files
from colonnade.protocol.reader import RunView, open_run
from colonnade.pulse import SCALE_SUFFIX, dequantize_rows
from colonnade.pulse.quant import is_adapter
from colonnade.store import NotFound, ObjectStore, open_store

WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's names: the model inside its wrapper
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
# config.json's dtype names (`dtype`, formerly `torch_dtype`) an export can write.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_DTYPE = "bfloat16"
_AT_VERSION = re.compile(r"(?P<url>.+)@v(?P<version>\d+)")

Say = Callable[[str], None]


class ExportError(ValueError):
    """A version that cannot be taken out, or a folder it cannot go to."""


@dataclass(frozen=True)
class Ref:
    """STORE[@vN]: a run's store and one of its versions (None: the newest)."""

    url: str
    version: int | None

    @classmethod
    def parse(cls, text: str) -> Ref:
        m = _AT_VERSION.fullmatch(text)
        return cls(m["url"], int(m["version"])) if m else cls(text, None)


def _local(url: str) -> Path | None:
    """The folder a local store URL names (None for s3://), as `open_store` reads it."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return Path(url).expanduser()
    return None


def names_a_run(text: str) -> bool:
    """Whether `text` names a published version rather than a model: STORE@vN,
    an s3:// prefix, or a local folder holding a run (its store or its run
    directory). A model folder holds config.json, never run.json."""
    ref = Ref.parse(text)
    if ref.version is not None:
        return True
    local = _local(ref.url)
    if local is None:
        return urlparse(ref.url).scheme == "s3"
    return (local / keys.RUN).is_file() or (local / "store" / keys.RUN).is_file()


def store_at(url: str, endpoint_url: str | None = None, profile: str | None = None) -> ObjectStore:
    """The run's store at `url`: a store folder, a run directory (its
    `store/`), file:// or s3://. A local folder that does not exist is an
    error, not a new empty store."""
    local = _local(url)
    if local is not None:
        if (local / "store" / keys.RUN).is_file():  # a run directory, as `colonnade run` makes
            return open_store(str(local / "store"))
        if not local.is_dir():
            raise ExportError(f"{url}: no such folder")
    return open_store(url, endpoint_url=endpoint_url, profile=profile)


def open_view(store: ObjectStore, trusted: str | None = None) -> RunView:
    """The run under `store`, verified (`open_run`); ExportError without run.json."""
    try:
        return open_run(store, trusted)
    except NotFound:
        raise ExportError(f"{store.url}: not a run (no run.json)") from None


def published(store: ObjectStore, view: RunView, version: int | None) -> int:
    """`version` (None: the newest), checked to be published and still in the store."""
    newest = latest_version(store, view.trust)
    if newest is None:
        raise ExportError(f"{store.url}: no version is published yet")
    if version is None:
        return newest
    if version > newest:
        raise ExportError(f"v{version} is not published: the newest is v{newest}")
    if read_meta(store, version, view.trust) is None:
        # Retention deletes meta.json first, so a version is gone before its payloads.
        raise ExportError(
            f"v{version} is no longer in the store: the trainer's retention keeps the versions "
            "from the previous anchor on (all of them with retain_all)"
        )
    return version


def rebuild(
    store: ObjectStore, view: RunView, version: int, say: Say | None = None
) -> dict[str, torch.Tensor]:
    """The state of published `version` as a worker holds it (int8 codes and
    scales, or bf16): the anchor and patches, every hash checked; VersionError
    where one does not rebuild as its meta.json promises."""
    follower = Follower(store, view.spec.anchor_every, view.trust)
    follower.sync(version)
    if say is not None:
        anchor = version - version % view.spec.anchor_every
        say(
            f"weights: v{version} rebuilt from the anchor v{anchor} and {version - anchor} "
            f"patch(es), {follower.bytes_read / 1e6:.1f} MB read, state hash as signed"
        )
    return follower.state


def export_dtype(config: dict) -> str:
    """The dtype config.json names (bf16 where it names none an export writes)."""
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPES else DEFAULT_DTYPE


def float_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The published tensors dequantized to `dtype`, one at a time (the whole
    state never sits in fp32): codes × row scales, others cast, and LoRA
    adapters merged into the weights they adapt (`model.lora.merge`, in
    float32 before the cast): a plain model's tensors."""
    from colonnade.model.lora import adapted, merge

    pairs = {f"{module}.weight": keys for module, keys in adapted(state).items()}
    out = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX) or is_adapter(name):
            continue
        scale = state.get(name + SCALE_SUFFIX)
        value = dequantize_rows(t, scale) if scale is not None else t
        if name in pairs:
            a, b = pairs[name]
            value = merge({name: value.float(), a: state[a], b: state[b]})[name]
        out[name] = value.to(dtype).contiguous() if value.is_floating_point() else value
    return out


def adapter_config(state: dict[str, torch.Tensor], base_model: str | None) -> dict:
    """adapter_config.json for the adapters of `state`, as PEFT reads it.
    lora_alpha = r (and no rsLoRA): PEFT's scale alpha / r is then 1, the
    scale the published B' already holds."""
    from colonnade.model.lora import adapted, rank_of

    rank = rank_of(state)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,
        "use_rslora": False,
        "use_dora": False,
        "target_modules": sorted({m.rpartition(".")[2] for m in adapted(state)}),
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of `state` by PEFT's names (as published: bf16)."""
    return {PEFT_PREFIX + k: t.contiguous() for k, t in state.items() if is_adapter(k)}


def base_model_name(config: dict) -> str | None:
    """The hub name config.json gives its model (`_name_or_path`), if it
    gives one: a path on the trainer's machine means nothing elsewhere."""
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and _HUB_NAME.fullmatch(name) else None


@dataclass(frozen=True)
class Exported:
    path: Path
    version: int
    dtype: str  # of the weights written ("bfloat16" for adapters, as published)
    adapter: bool = False  # a PEFT adapter folder, not a model folder


def check_target(out: Path, force: bool) -> None:
    """ExportError for a folder an export may not write: a file, or a folder
    with something in it (unless `force`)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another folder, or --force")


def export_version(
    store: ObjectStore,
    version: int | None,
    out: Path,
    *,
    trusted: str | None = None,
    force: bool = False,
    adapter: bool = False,
    say: Say | None = None,
) -> Exported:
    """Published `version` (None: the newest) as a model folder at `out`,
    its LoRA adapters (if any) merged in; with `adapter`, its adapters alone
    as a PEFT adapter folder (ExportError, nothing written, for a version
    without adapters).

    `trusted`: the trainer key's fingerprint to pin (default: run.json's own).
    `force`: replace a folder that holds something. `say`: progress lines."""
    say = say or (lambda _line: None)
    out = Path(out)
    check_target(out, force)
    view = open_view(store, trusted)
    v = published(store, view, version)
    head = f"export: v{v} of run {view.spec.run_id} from {store.url}"
    if adapter:  # whether it has adapters is known once rebuilt: no line before that
        rebuilt: list[str] = []
        state = rebuild(store, view, v, rebuilt.append)
        if not any(is_adapter(k) for k in state):
            raise ExportError(f"v{v} carries no LoRA adapters: leave out --adapter")
        for line in (head, *rebuilt):
            say(line)
    else:
        say(head)
        state = rebuild(store, view, v, say)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    # Provenance for whoever finds the folder later: strings, as safetensors wants.
    facts = {"format": "pt", "colonnade_run": view.spec.run_id, "colonnade_version": str(v)}
    try:
        names = fetch_files(store, view.spec, tmp)
        say(f"model files: {', '.join(sorted(names))} (each as its signed hash)")
        config = tmp / "config.json"
        if not config.is_file():
            raise ExportError("the run published no config.json")
        config = json.loads(config.read_text())
        if adapter:
            done = _write_adapter(tmp, state, config, names, facts, say)
        else:
            done = _write_model(tmp, state, config, facts, say)
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, v, done, adapter)


def _write_model(tmp: Path, state, config: dict, facts: dict, say: Say) -> str:
    """The weights, dequantized and merged, beside the model files in `tmp`; their dtype."""
    dtype = export_dtype(config)
    tensors = float_state(state, DTYPES[dtype])
    merged = sum(is_adapter(k) for k in state) // 2  # an A and a B each
    also = f", {merged} LoRA adapters merged in" if merged else ""
    say(f"writing {len(tensors)} tensors ({dtype}{also})")
    save_file(tensors, tmp / WEIGHTS, metadata=facts)
    return dtype


def _write_adapter(tmp: Path, state, config: dict, names, facts: dict, say: Say) -> str:
    """The adapters alone in `tmp`, as PEFT saves them (the model files go:
    an adapter folder holds its two files)."""
    for name in names:
        (tmp / name).unlink()
    tensors = adapter_tensors(state)
    settings = adapter_config(state, base_model_name(config))
    say(
        f"writing {len(tensors)} adapter tensors (LoRA r={settings['r']} on "
        f"{', '.join(settings['target_modules'])}, bfloat16 as published)"
    )
    save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata=facts)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(settings, indent=2) + "\n")
    return "bfloat16"


def _install(tmp: Path, out: Path) -> None:
    """`tmp` renamed to `out`; a folder there (empty, or replaced with
    --force) goes aside first and away after."""
    old = None
    if out.is_dir():
        old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
