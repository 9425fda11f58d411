"""Finding and loading causal LMs: presets, local directories, hub names.

A preset is built once into a cache directory named by the hash of what
defines it, published by an atomic rename so concurrent processes never load
a half-written model; afterwards every load is a plain `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from .presets import PRESETS, TinySpec, build_smollm2, build_tiny

READY = "colonnade-ready.json"


def cache_root() -> Path:
    """`$COLONNADE_CACHE`, else `~/.cache/colonnade`."""
    env = os.environ.get("COLONNADE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "colonnade"


def _texts_digest(texts: Iterable[str]) -> tuple[str, list[str]]:
    items = list(texts)
    h = hashlib.sha256()
    for t in items:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest(), items


def build_once(target: Path, build: Callable[[Path], None], facts: dict) -> Path:
    if (target / READY).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / READY).write_text(json.dumps(facts, sort_keys=True))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / READY).is_file():  # lost a race to a broken dir
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(
    name: str,
    texts: Iterable[str] | Callable[[], Iterable[str]] | None = None,
    spec: TinySpec | None = None,
    cache: Path | None = None,
) -> str:
    """A path (or hub name) `from_pretrained` can load for `name`.

    `name` is a preset (`tiny` needs `texts`, the text its tokenizer learns
    from, or a function that gives it: called only for `tiny`), a local model
    directory, or a hub name passed through unchanged.
    """
    root = cache or cache_root()
    spec = spec or TinySpec()
    if name == "tiny":
        if texts is None:
            raise ValueError("the tiny preset trains its tokenizer on the environment's text")
        if callable(texts):
            texts = texts()
        digest, items = _texts_digest(texts)
        facts = {"preset": "tiny", "spec": spec.as_dict(), "texts_sha256": digest}
        key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
        return str(
            build_once(root / "models" / f"tiny-{key}", lambda d: build_tiny(d, items, spec), facts)
        )
    if name == "smollm2-135m":
        facts = {"preset": name}
        return str(build_once(root / "models" / name, build_smollm2, facts))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        return str(path)
    if "/" not in name:
        raise ValueError(
            f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}), "
            "a local model directory or a hub name like org/model"
        )
    return name


# What a causal LM needs from a hub repository: weights, config, tokenizer.
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def local_model_dir(path: str) -> Path:
    """A directory holding the model's files: `path` itself, or a hub name
    fetched into the Hugging Face cache (a ValueError in one line where the
    hub cannot provide it: offline, unknown, gated)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=HUB_FILES, etag_timeout=30))
    except Exception as e:  # any failure to fetch is the same answer to the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"model {path!r} is not a local directory and the Hugging Face hub could not "
            f"provide it ({type(e).__name__}: {reason}); fetch it where the hub is reachable "
            f"(`hf download {path} --local-dir DIR`) and pass DIR"
        ) from None


@contextlib.contextmanager
def params_on_meta():
    """Within: every parameter a module registers is moved to the meta
    device as it is made (no memory kept), buffers stay real. A model built
    here has its computed buffers (rotary tables) but no weights: what a
    rank fills with its own shards (`train/loading.py`)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `path`'s config with its parameters on the meta device
    (tied where the config ties them), its buffers computed, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_tokenizer(path: str):
    """The tokenizer of a directory or hub name, with a pad token (its EOS where it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer) from a directory or hub name."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(device).eval()
    return model, tokenizer
