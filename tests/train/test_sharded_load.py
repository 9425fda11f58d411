"""Each trainer rank reads only its own rows of the weights.

A skeleton (parameters on the meta device, buffers computed) filled from
the model folder gives exactly the model `from_pretrained` loads: on one
process, and sharded over two gloo ranks (each reading its rows), for a
tied Llama and an untied Qwen3; a folder missing a weight is an error.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from colonnade.model import load_model, skeleton, tied_aliases
from colonnade.train.distributed import Dist
from colonnade.train.policy import build_policy, full_state
from mlx_archs import arch_tokenizer, tiny_model
from ports import free_port


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    """A model folder: the tied Llama or the untied Qwen3 (random init)."""
    tok = arch_tokenizer()
    model = tiny_model(request.param, tok)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _reference(model_dir) -> dict[str, torch.Tensor]:
    lm, _ = load_model(str(model_dir))
    aliases = tied_aliases(lm)
    return {k: v for k, v in lm.state_dict().items() if k not in aliases}


def test_a_skeleton_holds_no_weights_but_its_buffers():
    from mlx_archs import tiny_model as build

    tok = arch_tokenizer()
    real = build("llama", tok)
    with torch.device("cpu"):
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"skel-{os.getpid()}"
        real.save_pretrained(path)
    skel = skeleton(path)
    assert all(p.device.type == "meta" for p in skel.parameters())
    buffers = dict(real.named_buffers())
    for name, b in skel.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, buffers[name]), name
    assert skel.get_output_embeddings().weight is skel.get_input_embeddings().weight  # tied


def test_one_process_fills_a_skeleton_exactly(model_dir):
    skel = skeleton(model_dir)
    aliases = tied_aliases(skel)  # as the trainer takes them, from the skeleton
    assert aliases == tied_aliases(load_model(str(model_dir))[0])
    policy = build_policy(skel, Dist(), False, False, source=model_dir)
    got = full_state(policy, Dist(), aliases)
    ref = _reference(model_dir)
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name  # full_state is bf16


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        where = Dist(rank=rank, world=world, device=torch.device("cpu"), backend="gloo")
        skel = skeleton(model_dir)
        aliases = tied_aliases(skel)
        policy = build_policy(skel, where, False, False, source=model_dir)
        # What this rank holds: its own rows only.
        held = {n: list(p.to_local().shape) for n, p in policy.named_parameters() if p.dim() == 2}
        state = full_state(policy, where, aliases)
        if rank == 0:
            torch.save(state, Path(out) / "state.pt")
        (Path(out) / f"held-{rank}.json").write_text(json.dumps(held))
    finally:
        dist.destroy_process_group()


@pytest.mark.procs
def test_two_ranks_each_read_their_rows_and_gather_the_model(model_dir, tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(model_dir), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "state.pt", weights_only=True)  # our own file, tensors only
    ref = _reference(model_dir)
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    held = [json.loads((tmp_path / f"held-{r}.json").read_text()) for r in (0, 1)]
    for name, shape in held[0].items():
        rows = ref[name.removeprefix("lm.")].shape[0] if name.removeprefix("lm.") in ref else None
        if rows is not None:
            assert shape[0] + held[1][name][0] == rows and shape[0] < rows, name


def test_a_folder_missing_a_weight_is_an_error(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    dropped = sorted(k for k in state if "layers.0.mlp" in k)[0]
    del state[dropped]
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no weights for 1 parameter"):
        build_policy(skeleton(tmp_path), Dist(), False, False, source=tmp_path)
