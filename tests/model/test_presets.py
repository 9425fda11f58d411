import json
from pathlib import Path

import pytest

from colonnade.model import TinySpec, load_model, resolve_model
from colonnade.model.loading import READY
from conftest import TINY_TEXTS

SMALL = TinySpec(
    vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64
)


def test_tiny_is_built_once_and_keyed_by_its_inputs(tmp_path):
    a = resolve_model("tiny", TINY_TEXTS[:50], SMALL, cache=tmp_path)
    stamp = (Path(a) / READY).stat().st_mtime_ns
    assert resolve_model("tiny", TINY_TEXTS[:50], SMALL, cache=tmp_path) == a
    assert (Path(a) / READY).stat().st_mtime_ns == stamp
    b = resolve_model("tiny", TINY_TEXTS[:51], SMALL, cache=tmp_path)
    assert b != a
    assert json.loads((Path(a) / READY).read_text())["spec"]["hidden_size"] == 32
    # Nothing half-built is left beside the finished directories.
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(
        [Path(a).name, Path(b).name]
    )


def test_tiny_is_deterministic(tmp_path):
    a = resolve_model("tiny", TINY_TEXTS[:50], SMALL, cache=tmp_path / "x")
    b = resolve_model("tiny", TINY_TEXTS[:50], SMALL, cache=tmp_path / "y")
    ma, ta = load_model(a)
    mb, tb = load_model(b)
    assert ta.get_vocab() == tb.get_vocab()
    for (ka, va), (kb, vb) in zip(ma.state_dict().items(), mb.state_dict().items(), strict=True):
        assert ka == kb and va.equal(vb)


def test_tiny_loads_like_a_downloaded_model(tiny):
    model, tok = tiny
    assert type(model).__name__ == "LlamaForCausalLM"
    text = "<search>GX12 protein</search> ünïcode ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


def test_tiny_needs_texts_and_bad_names_say_why(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        resolve_model("tiny", None, cache=tmp_path)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model", cache=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path / "empty"), cache=tmp_path)
    assert resolve_model("org/model", cache=tmp_path) == "org/model"
