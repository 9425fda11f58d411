"""The weights workers run: PULSE int8 codes on an int8 weight-only CPU kernel.

The trainer publishes per-row symmetric int8 codes and float32 row scales
(`colonnade.pulse.quant`, one implementation for both sides). On CPU every
2-D linear becomes an `Int8Linear` that holds exactly those codes and scales
and computes y = (x · codesᵀ) · scale: bf16 activations times the codes,
sums in float32, the row scale applied afterwards in float32, on whichever
of the equivalent kernels in `colonnade.model.kernels` (torch's int8
weight-only kernel, oneDNN's bf16 GEMM on AMX...) this CPU runs fastest for
the shape and number of rows. That is weight-only quantization, as MLX's
int8 on Macs: the weights are the published ones, only activations round to
bf16 inside the matmul.

Why not fbgemm's dynamic int8 linear (W8A8, used before): it quantizes
activations with one scale per call, and real LLMs have outlier activation
channels. On SmolLM2-135M it gave a next-token KL of 0.96 nats against fp32
and log-probs that moved by up to 14 nats with the batch's make-up;
weight-only int8 gives a KL of 0.01 and is as fast or faster.

Sibling linears that read the same input (q/k/v, gate/up) run as one
linear over their stacked codes (`Siblings`): at one row a decode step is
hundreds of small matmuls, and each call costs its dispatch and conversions
beside the arithmetic; one wider call streams the same bytes with fewer of
them. The members keep their own codes and scales as views into the stacked
ones, so a patch loads into them as before.

Under `torch.compile` each linear is one opaque operator,
`colonnade::int8_linear` (`Int8Linear.traced`), whose body is the eager
path above: the compiler sees an output shape, never the kernels, so their
choice per number of rows and their packed forms stay as they are (inductor
cannot lower oneDNN's prepacked linear, and the choice depends on the rows
of each call). A sibling's call is its set's (`Siblings.compute`, stacked
or a call per member as measured) and a slice of it; `compile_options`
has the compiler merge the set's identical calls into one. The operator is
defined with `torch.library.Library`, not `custom_op`: a decode step calls
it hundreds of times, and `custom_op`'s Python wrapper costs several times
more a call.

Embedding tables are gathered, not multiplied: an `Int8Embedding` keeps the
codes and scales and dequantizes the rows a call gathers (the same float32
product per element as dequantizing the table, a quarter of its memory; a
tied head shares its codes). On CUDA/MPS the same codes run dequantized.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Set

import torch
from torch import nn

from colonnade.model.kernels import ROW_BUCKETS, Kernel, bucket, planner
from colonnade.pulse.quant import SCALE_SUFFIX, dequantize_rows

# Every Int8Linear and Siblings by its handle, the number a compiled graph
# names it by (an operator's arguments are tensors and numbers, not modules).
_HANDLES = itertools.count(1)
_BY_HANDLE: weakref.WeakValueDictionary[int, Int8Linear | Siblings] = weakref.WeakValueDictionary()

_LIB = torch.library.Library("colonnade", "FRAGMENT")
_LIB.define("int8_linear(Tensor x, int layer, int out_features) -> Tensor")


def _int8_linear(x: torch.Tensor, layer: int, out_features: int) -> torch.Tensor:
    return _BY_HANDLE[layer].compute(x)


def _int8_linear_shape(x: torch.Tensor, layer: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIB.impl("int8_linear", _int8_linear, "CPU")
_LIB.impl("int8_linear", torch.library.fallthrough_kernel, "Autograd")  # no gradients
torch.library.register_fake("colonnade::int8_linear", _int8_linear_shape, lib=_LIB)


def _register(layer: Int8Linear | Siblings) -> int:
    handle = next(_HANDLES)
    _BY_HANDLE[handle] = layer
    return handle


def _merge_calls(graph: torch.fx.Graph) -> None:
    """Identical `int8_linear` calls (a set of siblings' on one input) become
    one. Inductor does not merge them itself (an opaque call may have
    effects), and may give each a copy of the input of its own, so nothing
    at run time could tell the calls apart."""
    op = torch.ops.colonnade.int8_linear.default
    first: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is op and not node.kwargs:
            kept = first.setdefault(node.args, node)
            if kept is not node:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)


def compile_options() -> dict:
    """Inductor options a graph over Int8Linears is compiled with
    (`torch.compile(options=)`): `_merge_calls` among its graph passes."""
    # Imported here: torch._inductor is slow to import, and only compiling needs it.
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class MergeCalls(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            _merge_calls(graph)

        def uuid(self) -> str:  # what inductor's cache keys the pass by
            return "colonnade-merge-int8-calls-1"

    return {"post_grad_custom_pre_pass": MergeCalls()}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: first name} for parameters sharing storage (tied embeddings).
    On a skeleton (meta tensors: no storage) or a sharded model (DTensors),
    the tensors themselves: tied parameters are one object."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        stored = t.device.type != "meta" and not hasattr(t, "device_mesh")
        key = t.data_ptr() if stored else id(t)
        if key in seen and t.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return aliases


def publishable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors once each (a tied head is published as its embedding)."""
    aliases = tied_aliases(model)
    return {k: v.detach() for k, v in model.state_dict().items() if k not in aliases}


def int8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The int8 codes and scales a trainer publishes for these weights: the
    publisher's own path (bf16 first, then per-row codes), so a model run
    from here and one run from the store hold the same codes."""
    from colonnade.pulse import prepare

    return prepare(publishable_state(model), "int8")


class Int8Linear(nn.Module):
    """A linear layer running published int8 codes: y = (x · codesᵀ) · scale + bias.

    The matmul is whichever kernel `kernels.planner()` measured fastest on
    this CPU for the layer's shape and the call's number of rows; each keeps
    its own packed form of the codes, made at its first call.
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        copy: bool = True,
    ):
        super().__init__()
        # Set by `Siblings`: the stacked layer this one's output comes from,
        # and where this layer's columns start in its output.
        object.__setattr__(self, "_siblings", None)
        object.__setattr__(self, "_offset", 0)
        self.out_features, self.in_features = codes.shape
        # Copies of the state given, unless its holder never rewrites it
        # (`copy=False`): a whole worker rebuilds its next version inside
        # that state (PULSE in place) while this layer runs.
        codes = codes.detach().contiguous()
        self.register_buffer("codes", codes.clone() if copy else codes, persistent=False)
        self.register_buffer("scale", scale.detach().float().contiguous().clone(), persistent=False)
        self.bias = (
            None
            if bias is None
            else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        )
        self._plan: list[Kernel | None] = [None] * len(ROW_BUCKETS)
        self._packed: dict[str, tuple[torch.Tensor, ...]] = {}
        # The last call's row count, kernel, packed codes and the float32
        # tensors it applies, as plain attributes: a decode step calls every
        # linear with the same rows, and nn.Module's attribute lookup of
        # buffers costs more than a small matmul's arithmetic.
        self._last: tuple[int, object, tuple[torch.Tensor, ...]] | None = None
        # object.__setattr__: a Parameter assigned the usual way would be
        # registered a second time, under this name.
        object.__setattr__(self, "_scale", self.scale)
        object.__setattr__(self, "_bias", self.bias)
        self.handle = _register(self)

    def load(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        """A newer version's codes, in place (same shapes)."""
        self.codes.copy_(codes)
        self.scale.copy_(scale)
        self.forget_packed()
        if bias is not None and self.bias is not None:
            self.bias.data.copy_(bias)
        if self._siblings is not None:  # our codes are a view of its stacked ones
            self._siblings.layer.forget_packed()

    def forget_packed(self) -> None:
        """Pack the codes again at the next call (they were rewritten)."""
        self._packed.clear()
        self._last = None

    def kernel(self, rows: int) -> Kernel:
        """The kernel for a call with `rows` rows (chosen once per bucket)."""
        b = bucket(rows)
        chosen = self._plan[b]
        if chosen is None:
            chosen = self._plan[b] = planner().choose(self.out_features, self.in_features, rows)
        return chosen

    def packed(self, kernel: Kernel) -> tuple[torch.Tensor, ...]:
        """The codes in `kernel`'s form, made at its first use."""
        got = self._packed.get(kernel.name)
        if got is None:
            # Normal tensors even when the first call runs under
            # inference_mode: an inference tensor would poison later calls
            # that autograd tracks (a teacher-forced pass).
            with torch.inference_mode(False), torch.no_grad():
                got = self._packed[kernel.name] = kernel.pack(self.codes)
        return got

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self.traced(x)
        if self._siblings is not None:
            return self._siblings.output(self, x)
        return self.alone(x)

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        """The output as a compiled graph computes it: one opaque operator
        call (`compute`), or this sibling's columns of its set's call."""
        group = self._siblings
        if group is None:
            return torch.ops.colonnade.int8_linear(x, self.handle, self.out_features)
        every = torch.ops.colonnade.int8_linear(x, group.handle, group.layer.out_features)
        return every[..., self._offset : self._offset + self.out_features]

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """The operator's body: `alone`, a new tensor (a compiled graph may
        write into it once it is no longer read)."""
        return self.alone(x)

    def alone(self, x: torch.Tensor) -> torch.Tensor:
        """This layer's output from its own codes (also a sibling's, where
        a call per member is the faster way)."""
        flat = x.reshape(-1, self.in_features)
        rows, last = flat.shape[0], self._last
        if last is None or last[0] != rows:
            kernel = self.kernel(rows)
            last = self._last = (rows, kernel.run, self.packed(kernel))
        y = last[1](flat.to(torch.bfloat16), last[2])
        # bf16 · float32 promotes: the row scale (and bias) apply in float32.
        if self._bias is None:
            y = torch.mul(y, self._scale)
        else:
            y = torch.addcmul(self._bias, y, self._scale)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize_rows(self.codes, self.scale)


class Int8Embedding(nn.Module):
    """An embedding table as published int8 codes and row scales: a call
    gathers its rows' codes and scales them in float32, as dequantizing the
    whole table would, element by element. `embed_scale`: a scaled word
    embedding's factor (Gemma's), applied after, as its own forward does."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        embed_scale: torch.Tensor | None = None,
        copy: bool = True,
    ):
        super().__init__()
        codes = codes.detach().contiguous()
        self.register_buffer("codes", codes.clone() if copy else codes, persistent=False)
        self.register_buffer("scale", scale.detach().float().contiguous().clone(), persistent=False)
        self.embed_scale = embed_scale
        self.num_embeddings, self.embedding_dim = codes.shape

    def load(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """A newer version's codes, in place (same shapes)."""
        if self.codes.data_ptr() != codes.data_ptr():
            self.codes.copy_(codes)
        self.scale.copy_(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.codes).to(torch.float32)
        out = rows * self.scale[ids].unsqueeze(-1)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(torch.float32)
        return out

    def dequantized(self) -> torch.Tensor:
        return dequantize_rows(self.codes, self.scale)


def _embedding_scale(mod: nn.Module) -> torch.Tensor | bool | None:
    """What an embedding module multiplies its rows by: None for a plain
    `nn.Embedding`, a scaled word embedding's factor, or False for a kind
    whose forward does something else (it then runs dequantized)."""
    if type(mod) is nn.Embedding:
        return None
    factor = getattr(mod, "embed_scale", None)
    scaled = isinstance(mod, nn.Embedding) and type(mod).__name__.endswith("ScaledWordEmbedding")
    if scaled and isinstance(factor, torch.Tensor) and factor.numel() == 1 and not factor.is_meta:
        return factor.detach().clone()
    return False


# Sibling linears of one parent module that every architecture colonnade runs
# calls on the same input tensor, one after the other (attention's
# projections, a gated MLP's two inputs).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """Int8Linears that read the same input, run as one linear over their
    stacked codes: the first member called with an input computes every
    member's output, the others take theirs from it. Where the planner
    measured a call per member faster at a number of rows
    (`Planner.stacks`), each member runs alone instead.

    The members' codes, scales and biases become views into the stacked
    layer's, so loading a member's newer codes rewrites the stacked ones
    (and drops their packed forms). An input is recognised by identity
    (`is`), held until every member has taken its part: a member called with
    any other tensor computes afresh, so a caller that does not follow the
    pattern gets correct outputs, only without the saving.
    """

    def __init__(self, members: list[Int8Linear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        if any(m.bias is not None for m in members):
            bias = torch.cat(
                [
                    m.bias.data if m.bias is not None else torch.zeros(m.out_features)
                    for m in members
                ]
            )
        else:
            bias = None
        self.layer = Int8Linear(
            torch.cat([m.codes for m in members]), torch.cat([m.scale for m in members]), bias
        )
        start = 0
        for m, size in zip(members, self.sizes, strict=True):
            rows = slice(start, start + size)
            m.codes, m.scale = self.layer.codes[rows], self.layer.scale[rows]
            object.__setattr__(m, "_scale", m.scale)
            if m.bias is not None:
                m.bias.data = self.layer.bias.data[rows]
            object.__setattr__(m, "_siblings", self)
            object.__setattr__(m, "_offset", start)
            start += size
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor] = []
        self._waiting: set[int] = set()
        self._stack: list[bool | None] = [None] * len(ROW_BUCKETS)
        self._last: tuple[int, bool] = (0, True)  # rows of the last call, and its choice
        self.handle = _register(self)

    def stacked(self, rows: int) -> bool:
        """Whether a call with `rows` rows runs the stacked codes (chosen once per bucket)."""
        if self._last[0] != rows:
            b = bucket(rows)
            if self._stack[b] is None:
                self._stack[b] = planner().stacks(tuple(self.sizes), self.layer.in_features, rows)
            self._last = (rows, bool(self._stack[b]))
        return self._last[1]

    def output(self, member: Int8Linear, x: torch.Tensor) -> torch.Tensor:
        if not self.stacked(x.numel() // self.layer.in_features):
            return member.alone(x)
        i = next(j for j, m in enumerate(self.members) if m is member)
        if x is not self._input or i not in self._waiting:
            self._outputs = list(self.layer(x).split(self.sizes, dim=-1))
            self._input, self._waiting = x, set(range(len(self.members)))
        self._waiting.discard(i)
        out = self._outputs[i]
        if not self._waiting:  # every member served: hold nothing between calls
            self._input, self._outputs = None, []
        return out

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's output side by side (the operator's body for the set)."""
        if self.stacked(x.numel() // self.layer.in_features):
            return self.layer.alone(x)
        return torch.cat([m.alone(x) for m in self.members], dim=-1)


def fuse_siblings(model: nn.Module) -> int:
    """Group every set of `SIBLINGS` Int8Linears of one parent with one
    input width into `Siblings` (once; a model already grouped is left as
    it is). Returns the number of groups made."""
    made = 0
    for parent in model.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, Int8Linear) for m in members):
                continue
            if members[0]._siblings is not None:
                continue
            if len({m.in_features for m in members}) != 1:
                continue
            Siblings(members)
            made += 1
    return made


def lookup(qstate: Mapping[str, torch.Tensor], name: str, aliases: Mapping[str, str]) -> str:
    key = aliases.get(name, name)
    if key not in qstate:
        raise KeyError(f"int8 state has no tensor {key!r}")
    return key


def float_value(qstate: Mapping[str, torch.Tensor], name: str, aliases: Mapping[str, str]):
    """The model tensor `name` from an int8 state: dequantized if it has row scales."""
    key = lookup(qstate, name, aliases)
    scale = qstate.get(key + SCALE_SUFFIX)
    return qstate[key] if scale is None else dequantize_rows(qstate[key], scale)


def _copy_into(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    # Not load_state_dict: quantized linears insist on their own keys in it.
    with torch.no_grad():
        for name, value in tensors.items():
            mod_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(mod_name) if mod_name else model
            target = getattr(owner, attr)
            if target.shape != value.shape:
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)}, model wants {tuple(target.shape)}"
                )
            if target.is_meta:  # a skeleton (`model.skeleton`): the tensor is made here
                made = value.detach().to(target.dtype).clone()
                if attr in owner._parameters:
                    made = nn.Parameter(made, requires_grad=False)
                setattr(owner, attr, made)
            else:
                target.copy_(value)


def split_linears(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of the linear modules, names of every other tensor in the state).

    Linears run the int8 codes (torch's Int8Linear, MLX's 8-bit layout); the
    rest (embeddings, norms) run dequantized.
    """
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | Int8Linear)]
    linear_set = set(linear)
    return linear, [n for n in model.state_dict() if n.rpartition(".")[0] not in linear_set]


def _touched(key: str, changed: Set[str] | None) -> bool:
    """Whether the state tensor `key` (or its row scales) changed."""
    return changed is None or key in changed or key + SCALE_SUFFIX in changed


def load_int8(
    model: nn.Module,
    qstate: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    changed: Set[str] | None = None,
    fuse: bool = True,
    share: bool = False,
):
    """Run `qstate` (codes + scales) in `model` on CPU: linears become int8.

    `aliases` comes from `tied_aliases` on the float model (before the first
    call: a swapped model no longer shows its ties). Calling again with a
    newer state replaces the weights in place of the previous ones; with
    `changed` (the state keys a patch rewrote), only those: a worker's stall
    after a patch is then the apply, not a copy of the whole model. `fuse`:
    sibling linears run as one (`Siblings`); off only to measure the gain.
    `share`: the layers hold the state's codes themselves, not copies (for a
    state its holder never rewrites in place; `held_codes` gives back what
    the model holds, stacked siblings' views included).
    """
    linear_names, other_names = split_linears(model)
    tables = _load_tables(model, qstate, aliases, changed, share)
    rest = {
        name: float_value(qstate, name, aliases)
        for name in other_names
        if name not in tables and _touched(lookup(qstate, name, aliases), changed)
    }
    for name in linear_names:
        mod = model.get_submodule(name)
        key = lookup(qstate, f"{name}.weight", aliases)
        codes, scale = qstate[key], qstate[key + SCALE_SUFFIX]
        bias = qstate.get(f"{name}.bias")
        if isinstance(mod, Int8Linear):
            if _touched(key, changed) or _touched(f"{name}.bias", changed):
                mod.load(codes, scale, bias)
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if key in tables:  # a tied head: the embedding's codes, one copy for both
            layer = Int8Linear(tables[key].codes, scale, bias, copy=False)
        else:
            layer = Int8Linear(codes, scale, bias, copy=not share)
        setattr(parent, child, layer)
    if fuse:
        fuse_siblings(model)
    _copy_into(model, rest)
    return model


def _load_tables(model, qstate, aliases, changed, share) -> dict[str, Int8Embedding]:
    """The model's embedding tables that run as `Int8Embedding`s, made or
    loaded in place: {name and state key: module}."""
    out: dict[str, Int8Embedding] = {}
    kinds = nn.Embedding | Int8Embedding
    for owner_name, owner in [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]:
        name = f"{owner_name}.weight"
        key = lookup(qstate, name, aliases)
        scale = qstate.get(key + SCALE_SUFFIX)
        if scale is None:  # a table published unquantized runs as it came
            continue
        if isinstance(owner, Int8Embedding):
            if _touched(key, changed):
                owner.load(qstate[key], scale)
        else:
            factor = _embedding_scale(owner)
            if factor is False:
                continue
            parent_name, _, child = owner_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            owner = Int8Embedding(qstate[key], scale, factor, copy=not share)
            setattr(parent, child, owner)
        out[name] = out[key] = owner
    return out


def held_codes(model: nn.Module, aliases: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """{state key: the codes tensor the model runs} for every int8 linear
    and table of `model`: a stacked sibling's are views into its set's."""
    out: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Int8Linear | Int8Embedding):
            out.setdefault(aliases.get(f"{name}.weight", f"{name}.weight"), mod.codes)
    return out


def load_dequantized(
    model: nn.Module,
    qstate: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    changed: Set[str] | None = None,
) -> nn.Module:
    """The same int8 weights, dequantized into a float model (CUDA, MPS);
    with `changed`, only the tensors a patch rewrote."""
    if changed is None:
        own = model.state_dict()
        if any(t.is_meta for t in own.values()):  # a skeleton: its tensors made from the state
            made = {
                n: float_value(qstate, n, aliases).to(t.dtype, copy=True) for n, t in own.items()
            }
            model.load_state_dict(made, assign=True)
            return model
        model.load_state_dict({name: float_value(qstate, name, aliases) for name in own})
        return model
    names = [n for n in model.state_dict() if _touched(lookup(qstate, n, aliases), changed)]
    _copy_into(model, {n: float_value(qstate, n, aliases) for n in names})
    return model
