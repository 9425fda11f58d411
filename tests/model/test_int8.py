import copy

import torch

from colonnade.model import int8_state, load_dequantized, load_int8, load_model, tied_aliases
from colonnade.model.int8 import Int8Embedding, Int8Linear, held_codes
from colonnade.pulse.quant import SCALE_SUFFIX, dequantize_rows


def test_int8_linears_hold_exactly_the_published_codes(tiny_int8):
    model, state = tiny_int8
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert len(linears) == 4 * 7 + 1  # q k v o gate up down per layer, and the head
    for name, layer in linears.items():
        key = "model.embed_tokens.weight" if name == "lm_head" else f"{name}.weight"
        want = dequantize_rows(state[key], state[key + SCALE_SUFFIX])
        assert torch.equal(layer.codes, state[key]) and torch.equal(layer.dequantized(), want), name
    table = model.model.embed_tokens
    assert isinstance(table, Int8Embedding)
    emb = state["model.embed_tokens.weight"]
    want = dequantize_rows(emb, state["model.embed_tokens.weight" + SCALE_SUFFIX])
    assert torch.equal(table.codes, emb) and torch.equal(table.dequantized(), want)
    # The tied head runs the table's codes: one copy for both.
    assert model.lm_head.codes.data_ptr() == table.codes.data_ptr()


def test_int8_table_gathers_what_the_dequantized_table_holds(tiny_int8):
    # Rows scaled after the gather are the float32 products dequantizing
    # the whole table makes, bit for bit (a quarter of the memory).
    model, _ = tiny_int8
    table = model.model.embed_tokens
    ids = torch.tensor([[0, 5, 5, table.num_embeddings - 1], [3, 1, 2, 0]])
    assert torch.equal(table(ids), torch.nn.functional.embedding(ids, table.dequantized()))


def test_int8_table_keeps_a_scaled_embeddings_factor():
    class ScaledWordEmbedding(torch.nn.Embedding):  # Gemma's kind
        def __init__(self, n, d):
            super().__init__(n, d)
            self.embed_scale = torch.tensor(d**0.5)

        def forward(self, ids):
            return super().forward(ids) * self.embed_scale.to(self.weight.dtype)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = ScaledWordEmbedding(11, 16)
            self.odd = torch.nn.EmbeddingBag(11, 16)  # another forward: stays float

    model = Model()
    state = int8_state(model)
    float_model = Model()
    load_dequantized(float_model, state, {})
    ids = torch.tensor([[1, 2, 10]])
    want = float_model.embed(ids)
    load_int8(model, state, {})
    assert isinstance(model.embed, Int8Embedding) and torch.equal(model.embed(ids), want)
    assert isinstance(model.odd, torch.nn.EmbeddingBag)
    assert torch.equal(model.odd.weight, float_model.odd.weight)


def test_shared_layers_hold_the_states_codes(tiny):
    # share=True: the layers run the state's own tensors (a stage's
    # follower never rewrites them in place); stacked siblings cannot, and
    # `held_codes` gives their views for the holder to keep instead.
    model, _ = tiny
    aliases = tied_aliases(model)
    state = int8_state(model)
    load_int8(copy.deepcopy(model), state, aliases)  # the default: copies
    shared = load_int8(copy.deepcopy(model), state, aliases, share=True)
    down = "model.layers.0.mlp.down_proj.weight"
    assert shared.model.layers[0].mlp.down_proj.codes.data_ptr() == state[down].data_ptr()
    held = held_codes(shared, aliases)
    assert held.keys() == {k for k in state if not k.endswith(SCALE_SUFFIX) and state[k].dim() == 2}
    for key, codes in held.items():
        assert torch.equal(codes, state[key]), key
    q = held["model.layers.0.self_attn.q_proj.weight"]
    stacked = shared.model.layers[0].self_attn.q_proj._siblings.layer.codes
    assert q.data_ptr() == stacked.data_ptr()


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


def test_int8_linear_matches_its_dequantized_weights_on_every_width():
    # torch's int8 kernel needs in_features % 16 == 0; other widths run
    # another kernel. All compute x · (codes · scale)ᵀ, x rounded to bf16.
    torch.manual_seed(0)
    for in_f in (16, 48, 100, 192):
        codes = torch.randint(-127, 128, (33, in_f), dtype=torch.int8)
        scale = torch.rand(33) * 0.01
        layer = Int8Linear(codes, scale, torch.randn(33))
        assert layer.kernel(6).fits(33, in_f)
        x = torch.randn(2, 3, in_f)
        want = x @ dequantize_rows(codes, scale).t() + layer.bias
        got = layer(x)
        assert got.shape == (2, 3, 33) and got.dtype == torch.float32
        assert (got - want).abs().max() < 0.01 * want.abs().max(), in_f


def test_loading_a_newer_state_replaces_codes_in_place(tiny_dir, tiny):
    model, _ = load_model(tiny_dir)
    aliases = tied_aliases(model)
    first = int8_state(tiny[0])
    load_int8(model, first, aliases)
    layer = model.model.layers[0].mlp.up_proj
    newer = {k: v.clone() for k, v in first.items()}
    key = "model.layers.0.mlp.up_proj.weight"
    newer[key] = -newer[key]
    load_int8(model, newer, aliases)
    assert model.model.layers[0].mlp.up_proj is layer  # same module, new codes
    assert torch.equal(layer.codes, newer[key])


def _patched(state, names):
    """A newer state: `names` rewritten (new objects), every other tensor the same object."""
    out = dict(state)
    for n in names:
        t = state[n]
        out[n] = (t.float() * 1.5 + 0.01).to(t.dtype) if t.is_floating_point() else -t
    return out


def test_loading_only_the_changed_tensors_equals_a_full_load(tiny_dir, tiny):

    from colonnade.model import publishable_state
    from colonnade.pulse.quant import quantize_state

    aliases = tied_aliases(tiny[0])
    old = quantize_state(publishable_state(tiny[0]))
    linear = next(k for k in old if k.endswith("q_proj.weight"))
    norm = next(k for k in old if k.endswith("input_layernorm.weight"))
    embed = "model.embed_tokens.weight"  # tied: the head changes with it
    changed = {linear, linear + SCALE_SUFFIX, norm, embed, embed + SCALE_SUFFIX}
    new = _patched(old, sorted(changed))
    for load in (load_int8, load_dequantized):
        full = load(copy.deepcopy(tiny[0]), new, aliases)
        part = load(copy.deepcopy(tiny[0]), old, aliases)
        load(part, new, aliases, changed)
        want = {k: v for k, v in full.state_dict(keep_vars=True).items()}
        got = dict(part.state_dict(keep_vars=True))
        for name, m in full.named_modules():
            if isinstance(m, Int8Linear):
                other = part.get_submodule(name)
                assert torch.equal(m.codes, other.codes) and torch.equal(m.scale, other.scale)
        for k, v in want.items():
            assert torch.equal(v, got[k]), (load.__name__, k)


def test_a_model_directory_and_its_published_v0_run_identical_codes(tiny_dir, tmp_path):
    """One quantizer: `colonnade eval` of a directory, the run's eval before,
    and a worker on the run's v0 all run the codes the trainer published."""
    from colonnade.engine.loader import engine_for, load_engine
    from colonnade.model import publishable_state
    from colonnade.protocol import Follower, Publisher
    from colonnade.store import LocalStore

    direct = load_engine(tiny_dir, "int8", "cpu").backend.model
    model, tok = load_model(tiny_dir)
    store = LocalStore(tmp_path)
    Publisher(store, _signer(), "int8", anchor_every=10).publish(publishable_state(model))
    f = Follower(store, 10, _signer().trust)
    f.sync(0)
    skeleton, _ = load_model(tiny_dir)
    worker = engine_for(skeleton, tok, f.state, "int8", torch.device("cpu")).backend.model
    linears = [(n, m) for n, m in direct.named_modules() if isinstance(m, Int8Linear)]
    assert linears
    for name, m in linears:
        other = worker.get_submodule(name)
        assert torch.equal(m.codes, other.codes) and torch.equal(m.scale, other.scale), name
    for (n, a), (_, b) in zip(
        direct.state_dict().items(), worker.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0]


def test_sibling_linears_run_as_one_and_give_the_same_logits(tiny_dir, tiny):

    from colonnade.model.int8 import Siblings

    model, tok = tiny
    aliases, state = tied_aliases(model), int8_state(model)
    fused = load_int8(copy.deepcopy(model), state, aliases)
    apart = load_int8(copy.deepcopy(model), state, aliases, fuse=False)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(attn.q_proj._siblings, Siblings)
    assert attn.v_proj._siblings is attn.q_proj._siblings
    assert mlp.gate_proj._siblings.sizes == [mlp.gate_proj.out_features] * 2
    assert apart.model.layers[0].self_attn.q_proj._siblings is None
    # The members still hold exactly their published codes (views of the stack).
    key = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(attn.k_proj.codes, state[key])
    assert attn.k_proj.codes.data_ptr() != state[key].data_ptr()
    ids = torch.tensor([tok.encode("<search>gene GX3 protein</search> <information>GX3")])
    a, b = _logits(fused, ids), _logits(apart, ids)
    # Same arithmetic per output element; only the kernel chosen for the wider
    # shape may differ (every kernel is within kernels.TOLERANCE of the exact value).
    assert (a - b).abs().max() < 1e-3 * a.abs().max()


def test_a_patch_into_one_sibling_reaches_the_stacked_layer(tiny_dir, tiny):

    model, tok = tiny
    aliases, first = tied_aliases(model), int8_state(model)
    newer = dict(first)
    key = "model.layers.1.self_attn.v_proj.weight"
    newer[key] = -first[key]
    newer[key + SCALE_SUFFIX] = first[key + SCALE_SUFFIX] * 2
    ids = torch.tensor([tok.encode("<search>gene GX3 protein</search>")])
    patched = load_int8(copy.deepcopy(model), first, aliases)
    _logits(patched, ids)  # packed forms made from the old codes
    load_int8(patched, newer, aliases, {key, key + SCALE_SUFFIX})
    fresh = load_int8(copy.deepcopy(model), newer, aliases)
    assert torch.equal(_logits(patched, ids), _logits(fresh, ids))
    stacked = patched.model.layers[1].self_attn.v_proj._siblings.layer
    q, k = (patched.model.layers[1].self_attn.q_proj, patched.model.layers[1].self_attn.k_proj)
    assert torch.equal(stacked.codes[q.out_features + k.out_features :], newer[key])


def test_siblings_called_out_of_pattern_still_compute_their_own_outputs():
    from colonnade.model.int8 import Siblings

    torch.manual_seed(0)
    members = [
        Int8Linear(torch.randint(-127, 128, (n, 32), dtype=torch.int8), torch.rand(n) * 0.01, b)
        for n, b in ((16, torch.randn(16)), (8, None))
    ]
    alone = [Int8Linear(m.codes.clone(), m.scale.clone(), m.bias) for m in members]
    Siblings(members)
    x, y = torch.randn(3, 32), torch.randn(3, 32)
    # Interleaved inputs, a member called twice. The stacked shape may run
    # another kernel than each member's own (all within kernels.TOLERANCE).
    for i, inp in ((0, x), (0, y), (1, x), (0, x), (1, y)):
        got, want = members[i](inp), alone[i](inp)
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), (i, inp is x)
    assert members[1].bias is None and torch.equal(members[0].bias, alone[0].bias)


_SIGNER = []


def _signer():
    """One trainer key for the module: its publisher and followers agree."""
    if not _SIGNER:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from colonnade.protocol.signing import Signer

        _SIGNER.append(Signer(Ed25519PrivateKey.generate(), "r1"))
    return _SIGNER[0]
