"""Spot checks: honest rows pass at the trainer's tolerance across lags and
engines; each forger's rows fail when they are checked; rows are chosen at
the rate, by randomness no worker knows; a failed row rejects its batch as
forged and names its worker for quarantine."""

import random
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from colonnade.bench import verify
from colonnade.config import TrainerConfig
from colonnade.engine import refresh
from colonnade.engine.mlx_backend import mlx_missing
from colonnade.model import int8_state, load_model
from colonnade.protocol.draws import forged_draws
from colonnade.train.spot import Row, SpotChecker, Tolerance, recompute, row_gap

# The tiny model's logits sharpened (its final norm scaled): next-token
# distributions far from uniform, as a trained model's are; a random-init
# model's are near uniform, and any two of them look alike.
SHARPEN = 4.0
# Each version moves every weight by this much, as an Adam step at lr 1e-3 does.
STEP = 1e-3
# What a run of this model could set (its honest rows stand well inside it on
# both engines): the trainer's defaults are wide enough for deeper models.
TIGHT = Tolerance(logp=0.02, interval=0.02)


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """(world, published states of v0..v3, honest batches by (engine,
    version), each forger's batch)."""
    model, tok = load_model(tiny_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    w = verify.world(verify.Options(), str(out))
    states = {0: int8_state(model)}
    gen = torch.Generator().manual_seed(0)
    for v in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(STEP * torch.sign(torch.randn(p.shape, generator=gen)))
        states[v] = int8_state(model)
    engine = verify.engine_at(w, states[0], 0)
    honest = {}
    for v in (0, 1, 2):
        refresh(engine, states[v], None, v)
        honest[("torch", v)] = verify.make_batch(w, engine, v, [v])[0]
    if mlx_missing() is None:
        mlx = verify.engine_at(w, states[2], 2, "mlx")
        honest[("mlx", 2)] = verify.make_batch(w, mlx, 2, [3])[0]
    return w, states, honest, _forgers(w, states, engine, honest)


def _forgers(w, states, engine, honest):
    """Each forger's batch naming v2 (`engine` holds v2)."""
    truth = engine.backend.model
    out = {}
    for name, forge in (("swap", False), ("swap-forged", True)):
        out[name] = verify.swapped(w, truth, honest[("torch", 2)], random.Random(1), forge)
    hot = replace(w.params, temperature=verify.HOT)
    out["hot"] = verify.make_batch(w, engine, 2, [4], params=hot, worker="hot")[0], None
    stale = verify.engine_at(w, states[0], 0)
    out["stale"] = verify.make_batch(w, stale, 0, [5], label=2)[0], None
    out["relabel"] = verify.relabelled(w, truth, honest[("torch", 1)], 2), None
    return out


def _checker(w, states, versions=(0, 1, 2), rate=1.0, tolerance=TIGHT):
    checker = verify.spot_checker(w, rate)
    checker.tolerance = tolerance
    for v in versions:
        checker.add(v, states[v])
    return checker


def _every(batch):
    return [(g, e) for g, grp in enumerate(batch.groups) for e in range(len(grp.episodes))]


def test_honest_rows_pass_across_lags_and_engines(run):
    w, states, honest, _ = run
    checker = _checker(w, states)  # a step at v2 with max_lag 2: v0, v1, v2 held
    default = TrainerConfig()
    for (engine, v), batch in honest.items():
        gaps = checker.gaps(batch, _every(batch))
        assert all(g is not None and not g.fails(TIGHT) for g in gaps), (engine, v)
        # Far inside the trainer's default tolerance, not just under it.
        assert max(g.logp for g in gaps) < default.spot_logp_tolerance / 10
        assert max(g.interval for g in gaps) < default.spot_interval_tolerance / 10
        assert checker(batch) is None
    assert sum(g.tokens for g in checker.gaps(honest[("torch", 2)], _every(honest[("torch", 2)])))
    # v3 published: v0 leaves the window, and its rows are no longer checked.
    checker.add(3, states[3])
    assert checker.gaps(honest[("torch", 0)], [(0, 0)]) == [None]
    assert checker(honest[("torch", 0)]) is None


def test_recomputing_in_chunks_and_alone_agree(run, monkeypatch):
    # Rows padded together, in chunks of any size, give what each row alone
    # gives, up to the int8 kernel's rounding, which differs with the number
    # of rows a call runs (a misplaced column would be off by far more).
    import colonnade.train.spot as spot

    w, states, honest, _ = run
    model = verify.engine_at(w, states[2], 2).backend.model
    batch = honest[("torch", 2)]
    prompt = verify.prompt_of(w, batch.groups[0].task_id)
    rows = [Row(prompt, ep.tokens, ep.from_model) for ep in batch.groups[0].episodes]
    together = recompute(model, rows, w.params, 0)
    monkeypatch.setattr(spot, "LOGIT_POSITIONS", 1)
    alone = recompute(model, rows, w.params, 0)
    for (a, b), (c, d) in zip(together, alone, strict=True):
        gap = row_gap(a, b, c, d)
        assert gap.logp < 0.01 and gap.interval < 0.01


def test_a_truthful_swap_is_caught_by_the_free_check(run):
    w, _, _, forgers = run
    batch, swapped = forgers["swap"]
    assert swapped > 0
    proof = forged_draws(batch, verify.RUN, w.train, w.cfg.groups_per_batch, sampled=True)
    assert proof is not None and "outside the intervals" in proof


@pytest.mark.parametrize("name", ["swap-forged", "hot", "stale", "relabel"])
def test_a_consistent_forger_passes_the_free_check_and_fails_the_spot_check(run, name):
    w, states, honest, forgers = run
    batch, _ = forgers[name]
    assert not verify.rows_outside(batch)  # every draw falls in its reported interval
    if name == "swap-forged":
        base = honest[("torch", 2)].groups
        rows = [(g, e) for g, e in _every(batch)
                if batch.groups[g].episodes[e].tokens != base[g].episodes[e].tokens]  # fmt: skip
        assert rows
    else:
        rows = _every(batch)
    checker = _checker(w, states)
    caught = [g.fails(checker.tolerance) for g in checker.gaps(batch, rows)]
    assert np.mean(caught) >= 0.9, (name, np.mean(caught))
    proof = checker(batch)
    assert proof is not None and proof.startswith("spot check: episode")


def test_rows_are_chosen_at_the_rate_by_no_seed_a_worker_knows(run):
    w, states, honest, _ = run
    checker = _checker(w, states, rate=0.1)
    batch = honest[("torch", 2)]
    rows = len(_every(batch))
    chosen = [len(checker.choose(batch)) for _ in range(2000)]
    share = sum(chosen) / (rows * 2000)
    assert abs(share - 0.1) < 5 * (0.1 * 0.9 / (rows * 2000)) ** 0.5
    # Seeding every generator a worker could know reproduces nothing.
    picks = []
    for _ in range(2):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        picks.append([checker.choose(batch) for _ in range(50)])
    assert picks[0] != picks[1]


def test_a_forged_row_rejects_its_batch_and_names_its_worker(run, tmp_path):
    from colonnade.protocol import encode_batch, keys
    from colonnade.protocol.documents import Claim, seal_claim
    from colonnade.store import LocalStore
    from colonnade.train.collect import Collector
    from colonnade.train.samples import rebuild_group

    w, states, honest, forgers = run
    store = LocalStore(tmp_path)
    hot, _ = forgers["hot"]
    for batch in (honest[("torch", 2)], hot):
        key = keys.claim_key(2, batch.slot)
        store.put(key, seal_claim(None, verify.RUN, key, Claim(batch.worker, 0.0)))
        store.put(keys.rollout_key(2, batch.worker, 0), encode_batch(batch))
    train = set(w.train)
    c = Collector(
        store,
        verify.RUN,
        lambda g, v: rebuild_group(w.tok, w.env, g, v, w.params.stop, 2048, train),
        vocab=len(w.tok),
        max_tokens=w.cfg.max_episode_tokens + w.cfg.max_turn_tokens,
        max_lag=2,
        poll_seconds=0.01,
        check_draws=lambda b: forged_draws(b, verify.RUN, w.train, 2, sampled=True),
        spot=_checker(w, states),
    )
    got = c.collect(2, need=4, stop=lambda taken: True)
    assert got.keys == [keys.rollout_key(2, verify.WORKER, 0)] and len(got.groups) == 2
    assert c.counts["rejected_forged"] == 1 and "hot" in c.quarantined
    assert c.forged["hot"].startswith("spot check: episode")


def test_the_lead_hands_each_published_state_to_the_checker(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.protocol.metrics import TrainerRow
    from colonnade.protocol.signing import public_hex
    from colonnade.store import LocalStore
    from colonnade.train.lead import Lead
    from colonnade.train.trainer import run_spec

    cfg = TrainerConfig(store=str(tmp_path), env="smoke", max_lag=1)
    private = Ed25519PrivateKey.generate()
    lead = Lead(cfg, LocalStore(tmp_path), private, "0a1b2c3d", env=None, checkpoint=print)
    lead.bind(run_spec(cfg, {}, 64, public_hex(private.public_key())))
    state = {"w": torch.randn(8, 8)}
    lead.publisher.publish(state)
    checker = SpotChecker(lambda: None, None, None, None, "int8", 0.5, None, keep=2)
    lead.start_collecting(lambda g, v: [], None, checker)
    assert list(checker.states) == [0] and lead.collector.spot is checker
    for v in (1, 2):
        state = {"w": state["w"] + 1}
        lead.publish(state, TrainerRow(time=time.time(), version=v), set())
        assert checker.states[v] is lead.publisher.last
    assert sorted(checker.states) == [1, 2]  # max_lag 1: two versions held


def test_spot_settings_are_checked():
    TrainerConfig(spot_rate=0.0).check()
    for bad in ({"spot_rate": 1.5}, {"spot_rate": -0.1}, {"spot_logp_tolerance": 0.0}):
        with pytest.raises(ValueError, match="spot_"):
            TrainerConfig(**bad).check()


def test_a_check_runs_on_one_thread_and_gives_the_others_back():
    from colonnade.train.spot import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert one_thread(torch.get_num_threads) == 1
        with pytest.raises(ZeroDivisionError):
            one_thread(lambda: 1 / 0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
