import torch
from torch.ao.nn.quantized import dynamic as nnqd

from colonnade.model import int8_state, load_dequantized, load_model, tied_aliases
from colonnade.pulse.quant import SCALE_SUFFIX, dequantize_rows


def test_int8_linears_hold_exactly_the_published_codes(tiny_int8):
    model, state = tiny_int8
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nnqd.Linear)}
    assert len(linears) == 4 * 7 + 1  # q k v o gate up down per layer, and the head
    for name, layer in linears.items():
        key = "model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"
        want = dequantize_rows(state[key], state[key + SCALE_SUFFIX])
        assert torch.equal(layer.weight().dequantize(), want), name
    emb = state["model.embed_tokens.weight"]
    want = dequantize_rows(emb, state["model.embed_tokens.weight" + SCALE_SUFFIX])
    assert torch.equal(model.model.embed_tokens.weight, want)


def test_tied_head_is_published_once(tiny):
    model, _ = tiny
    assert tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in int8_state(model)


def _kl(p_logits, q_logits):
    p = torch.log_softmax(p_logits.float(), -1)
    q = torch.log_softmax(q_logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def test_int8_logits_stay_close_to_fp32(tiny, tiny_int8):
    # Bound: mean next-token KL(fp32 || int8) below 1e-3 nats and the
    # largest logit error under 10% of the largest logit on the tiny preset
    # (measured: KL ~1e-4, error ~3%).
    model, tok = tiny
    qmodel, _ = tiny_int8
    ids = torch.tensor([tok.encode("<search>gene GX3 protein</search> <information>GX3 binds")])
    with torch.no_grad():
        a, b = model(ids).logits[0], qmodel(ids).logits[0]
    assert _kl(a, b).mean() < 1e-3
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_dequantized_path_runs_the_same_weights(tiny_dir, tiny, tiny_int8):
    _, state = tiny_int8
    model, _ = load_model(tiny_dir)
    load_dequantized(model, state, tied_aliases(model))
    q = model.model.layers[1].mlp.down_proj.weight
    key = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(q, dequantize_rows(state[key], state[key + SCALE_SUFFIX]))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
