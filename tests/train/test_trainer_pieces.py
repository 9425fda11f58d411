"""The trainer's pieces on one process: checkpoints through DCP, background
publication, the resume after a publication cut short, and its clean errors."""

import copy
import threading
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.background import Background
from colonnade.cli.main import main
from colonnade.model import tied_aliases
from colonnade.protocol import keys
from colonnade.protocol.signing import Signer
from colonnade.store import LocalStore
from colonnade.train.checkpoint import (
    FORMAT,
    Checkpointer,
    CheckpointError,
    checkpoints,
    init_adam_state,
    latest_checkpoint,
    prune_checkpoints,
)
from colonnade.train.distributed import Dist
from colonnade.train.policy import build_policy
from colonnade.train.trainer import compute_dtype


def _policy_and_opt(tiny):
    lm = copy.deepcopy(tiny[0])
    aliases = tied_aliases(lm)
    policy = build_policy(lm, Dist(), bf16=False, grad_ckpt=False)
    return policy, torch.optim.AdamW(policy.parameters(), lr=1e-2), aliases


def _one_update(policy, opt, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = policy.lm.config.vocab_size
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    ones = torch.ones_like(ids)
    opt.zero_grad()
    policy(ids, ones, ones.cumsum(-1) - 1, ids[:, -5:]).sum().backward()
    opt.step()


def _signer():
    return Signer(Ed25519PrivateKey.generate(), "r1")


def test_a_checkpoint_restores_weights_and_adam_exactly(tiny, tmp_path):
    store = LocalStore(tmp_path / "store")
    signer = _signer()
    a, opt_a, aliases = _policy_and_opt(tiny)
    _one_update(a, opt_a, 0)
    saver = Checkpointer(store, a, opt_a, Dist(), tmp_path / "staging", aliases, signer)
    saver.save(3, {"x": 1})
    saver.finish()
    b, opt_b, _ = _policy_and_opt(tiny)
    state = Checkpointer(store, b, opt_b, Dist(), tmp_path / "staging", aliases, signer).load(3)
    assert state["x"] == 1 and state["ranks"] == 1 and latest_checkpoint(store, signer.trust) == 3
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    # The same next update on both: Adam's moments and step count came back.
    _one_update(a, opt_a, 1)
    _one_update(b, opt_b, 1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert b.lm.lm_head.weight is b.lm.model.embed_tokens.weight  # still tied
    assert not list((tmp_path / "staging").iterdir())  # staging cleaned up


class SlowUploads(LocalStore):
    """A store whose shard uploads wait until `go` is set."""

    def __init__(self, root):
        super().__init__(root)
        self.go = threading.Event()

    def put_file(self, key, path):
        assert self.go.wait(30), "the upload was never let through"
        return super().put_file(key, path)


def test_a_checkpoint_uploads_in_the_background_and_commits_when_up(tiny, tmp_path):
    store = SlowUploads(tmp_path / "store")
    signer = _signer()
    a, opt_a, aliases = _policy_and_opt(tiny)
    saver = Checkpointer(store, a, opt_a, Dist(), tmp_path / "staging", aliases, signer, keep=1)
    assert saver.save(1) < 0.5  # nothing in flight; returns with the shard written, not up
    assert checkpoints(store) == [] and saver.uploads.busy
    _one_update(a, opt_a, 0)  # the next step trains meanwhile
    store.go.set()
    assert saver.save(2) >= 0.0  # waited for v1's upload, then wrote v2
    saver.finish()
    assert checkpoints(store) == [2]  # v1 committed, then pruned once v2 was (keep=1)
    assert latest_checkpoint(store, signer.trust) == 2


def test_a_checkpoint_missing_a_ranks_shards_is_not_committed(tiny, tmp_path):
    # Rank 0 of 2 (its peer never uploads): it waits for the peer's marker,
    # then gives up without state.json; a resume ignores the checkpoint.
    store = LocalStore(tmp_path / "store")
    a, opt_a, aliases = _policy_and_opt(tiny)
    where = Dist(rank=0, world=2)
    saver = Checkpointer(store, a, opt_a, where, tmp_path / "staging", aliases, _signer(),
                         ranks_seconds=0.5)  # fmt: skip
    saver.save(4)
    with pytest.raises(CheckpointError, match="1 of 2 ranks"):
        saver.finish()
    assert checkpoints(store) == []


def test_initialised_adam_state_is_a_fresh_optimizer(tiny):
    a, opt_a, _ = _policy_and_opt(tiny)
    b, opt_b, _ = _policy_and_opt(tiny)
    init_adam_state(opt_b)  # what a v0 checkpoint does before saving
    _one_update(a, opt_a, 2)
    _one_update(b, opt_b, 2)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def _state(signer, v) -> bytes:
    """A checkpoint's state.json as the trainer signs it."""
    shard = {"bytes": 1, "hash": "blake3:" + "0" * 64}
    doc = {"version": v, "format": FORMAT, "ranks": 1, "shards": {"shard-1.safetensors": shard}}
    return signer.seal(keys.checkpoint_state_key(v), doc)


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    for v in (0, 5, 10, 15):
        store.put(f"trainer/checkpoints/{v:08d}/shard-1.safetensors", b"x")
        store.put(keys.checkpoint_state_key(v), _state(signer, v))
    store.put("trainer/checkpoints/00000020/shard-1.safetensors", b"half")  # no state.json
    assert prune_checkpoints(store, keep=2) == 2
    left = sorted({k.split("/")[2] for k in store.list("trainer/checkpoints/")})
    assert left == ["00000010", "00000015", "00000020"]
    assert latest_checkpoint(store, signer.trust) == 15


def test_a_checkpoint_the_trainer_did_not_sign_is_passed_over(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    store.put(keys.checkpoint_state_key(5), _state(signer, 5))
    store.put(keys.checkpoint_state_key(10), _state(_signer(), 10))  # another key
    forged = signer.seal(keys.checkpoint_state_key(15), {"x": 1})  # signed, but moved:
    store.put(keys.checkpoint_state_key(20), forged)  # the key is part of the signature
    assert latest_checkpoint(store, signer.trust) == 5


def test_background_runs_one_job_at_a_time_in_order():
    bg = Background()
    order, running = [], []

    def job(i):
        def run():
            running.append(i)
            assert len(running) == 1, "two publications in flight"
            time.sleep(0.05)
            order.append(i)
            running.remove(i)

        return run

    waited = [bg.submit(job(i)) for i in range(4)]
    bg.close()
    assert order == [0, 1, 2, 3]
    assert waited[0] < 0.01 and all(w > 0.02 for w in waited[1:])


def test_a_failed_publication_raises_in_the_trainer():
    bg = Background()
    started = threading.Event()

    def boom():
        started.set()
        raise RuntimeError("store down")

    bg.submit(boom)
    started.wait(5)
    with pytest.raises(RuntimeError, match="store down"):
        bg.wait()
    bg.close()


def test_compute_dtype_defaults():
    assert compute_dtype("auto", torch.device("cuda")) == "bf16"
    assert compute_dtype("auto", torch.device("cpu")) == "fp32"
    assert compute_dtype("bf16", torch.device("cpu")) == "bf16"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_trainer_cuda_without_cuda_is_one_line(tmp_path, capsys):
    rc = main(["trainer", "--store", str(tmp_path / "s"), "--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: device 'cuda' requested but torch sees no CUDA device"]
    assert not (tmp_path / "s" / "run.json").exists()


def test_trainer_hub_model_offline_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["trainer", "--store", str(tmp_path / "s"), "--model", "org/nothing-here"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("error: model 'org/nothing-here' is not a local directory")
    assert not (tmp_path / "s" / "run.json").exists()


def test_resume_publishes_a_checkpoint_whose_version_was_cut_short(tiny_dir, tmp_path):
    from colonnade import pulse
    from colonnade.config import TrainerConfig
    from colonnade.protocol import Follower, latest_version, read_meta
    from colonnade.protocol.signing import new_keypair
    from colonnade.train.trainer import Trainer

    key, _ = new_keypair("trainer", tmp_path / "keys")
    cfg = TrainerConfig(store=str(tmp_path / "s"), env="smoke", model=tiny_dir, key=str(key),
                        staging_dir=str(tmp_path / "staging"))  # fmt: skip
    first = Trainer(cfg)
    first.open()  # v0 published, checkpoint v0
    first._save(1)  # the checkpoint of v1 went up; v1's background publication did not
    first.checkpoints.finish()
    first.background.close()
    trust = first.signer.trust
    assert latest_version(first.store, trust) == 0 and latest_checkpoint(first.store, trust) == 1
    again = Trainer(TrainerConfig(**{**cfg.__dict__, "takeover": True}))
    again.open()
    assert again.signer.trust == trust  # the same run, the same key
    assert again.version == 1 == latest_version(again.store, trust)
    f = Follower(again.store, cfg.anchor_every, trust)
    f.sync(1)
    assert pulse.state_hash(f.state) == read_meta(again.store, 1, trust).state_hash
    assert (
        read_meta(again.store, 1, trust).state_hash == read_meta(again.store, 0, trust).state_hash
    )


@pytest.mark.s3
def test_a_checkpoint_goes_to_s3_in_parts_and_comes_back(tiny, tmp_path, seaweed, monkeypatch):
    from s3server import make_s3_store

    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    store = make_s3_store(seaweed, multipart_bytes=5 << 20)
    signer = _signer()
    a, opt_a, aliases = _policy_and_opt(tiny)
    _one_update(a, opt_a, 3)
    saver = Checkpointer(store, a, opt_a, Dist(), tmp_path / "staging", aliases, signer)
    saver.save(1)
    saver.finish()
    (shard,) = [k for k in store.list("trainer/checkpoints/") if k.endswith(".safetensors")]
    assert store.size(shard) > 2 * (5 << 20)  # weights and Adam's moments: several parts
    head = store.client.head_object(Bucket=store.bucket, Key=store._k(shard))
    assert head["ETag"].strip('"').endswith(tuple(f"-{n}" for n in range(2, 100)))  # multipart
    b, opt_b, _ = _policy_and_opt(tiny)
    Checkpointer(store, b, opt_b, Dist(), tmp_path / "staging", aliases, signer).load(1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_out_of_range_settings_fail_when_the_config_is_built():
    # max_lag=-1 was accepted here and failed later in a worker.
    from colonnade.config import TrainerConfig

    TrainerConfig().check()
    for bad in (
        {"max_lag": -1},
        {"group_size": 1},
        {"lr": 0.0},
        {"max_grad_norm": 0.0},
        {"max_turn_tokens": 600},  # more than the episode's 512
    ):
        with pytest.raises(ValueError, match="out of range: .*" + next(iter(bad))):
            TrainerConfig(**bad).check()


def test_max_grad_norm_and_scale_by_std_reach_the_step(tiny_dir, tmp_path):
    # Settings the step had but no config could set before.
    from colonnade.config import TrainerConfig
    from colonnade.protocol.signing import new_keypair
    from colonnade.train.trainer import Trainer

    key, _ = new_keypair("trainer", tmp_path / "keys")  # not one made in the user's cache
    cfg = TrainerConfig(store=str(tmp_path / "s"), env="smoke", model=tiny_dir, key=str(key),
                        max_grad_norm=0.25, scale_by_std=True)  # fmt: skip
    step = Trainer(cfg).step_cfg
    assert step.max_grad_norm == 0.25 and step.scale_by_std


def test_worker_keys_without_a_key_are_one_line_and_nothing_written(tmp_path, capsys):
    empty = tmp_path / "pubkeys"
    empty.mkdir()
    store = tmp_path / "s"
    rc = main(["trainer", "--store", str(store), "--env", "smoke", "--model", "tiny",
               "--worker-keys", str(empty)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no public keys" in err[0]
    assert not (store / "run.json").exists()


def test_cpu_offload_off_cuda_is_one_line(tmp_path, capsys, tiny_dir):
    # FSDP2's CPU offload moves states between host and GPU: on the CPU it
    # means nothing, and the trainer says so before writing anything. (The
    # model is one already built: building prints its own progress.)
    store = tmp_path / "s"
    rc = main(["trainer", "--store", str(store), "--env", "smoke", "--model", tiny_dir,
               "--cpu-offload"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cpu_offload needs a CUDA device" in err[0]
    assert not (store / "run.json").exists()


def test_a_checkpoint_holds_the_weights_of_its_step_not_of_the_next(tiny, tmp_path, monkeypatch):
    # The write runs in DCP's thread while the next step trains: what it
    # writes is the copy taken when save() returned. The write waits here
    # until the next step is done (a save that wrote in place would hang).
    import torch.distributed.checkpoint as dcp

    stepped = threading.Event()
    write = dcp.HuggingFaceStorageWriter.write_data

    def after_the_step(self, *args, **kwargs):
        assert stepped.wait(30), "save() waited for its own write"
        return write(self, *args, **kwargs)

    monkeypatch.setattr(dcp.HuggingFaceStorageWriter, "write_data", after_the_step)
    store = SlowUploads(tmp_path / "store")
    signer = _signer()
    a, opt_a, aliases = _policy_and_opt(tiny)
    _one_update(a, opt_a, 0)
    saved = {n: p.detach().clone() for n, p in a.named_parameters()}
    saver = Checkpointer(store, a, opt_a, Dist(), tmp_path / "staging", aliases, signer,
                         background_write=True)  # fmt: skip
    saver.save(1)
    _one_update(a, opt_a, 1)  # moves every weight before the write
    stepped.set()
    store.go.set()
    saver.finish()
    b, opt_b, _ = _policy_and_opt(tiny)
    Checkpointer(store, b, opt_b, Dist(), tmp_path / "staging", aliases, signer).load(1)
    for n, p in b.named_parameters():
        assert torch.equal(p, saved[n]), n
