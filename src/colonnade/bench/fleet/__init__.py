"""`colonnade bench fleet`: the store protocol at fleet scale, on a simulated WAN.

One process runs the real trainer (tiny model, smoke environment) and a
fleet of simulated workers, one thread each. A simulated worker is the real
`Worker`: it reads run.json and the model files, follows the versions with
the real `Follower` (anchor on joining, a PULSE patch per version after),
paces or claims work however the worker does, and uploads signed batches
that the trainer verifies, replays and trains on. Only the model is gone:
its engine is a stand-in that holds the version, and `make_batch` writes
valid smoke episodes (the answer tokens, right or not) after sleeping
`--gen-seconds` for the generation it stands for, so that a large fleet fits
on a few cores; each worker still holds its own follower state.

Every client sees the store through its own `WanStore`: requests counted by
verb, one round trip of `--latency-ms` each, payloads over a
`--bandwidth-mbit` line per worker. `--churn` replaces that share of the
fleet at each version (leavers finish their batch; joiners have fresh ids
and keys registered in advance). After the run a joiner catches up from
nothing, timed over the same link.

Per version and in total it reports requests per worker by verb, bytes
downloaded per worker, anchor downloads by following workers (a worker's
downloads after its first), waste (uploaded groups never trained on over
uploaded), the trainer's wait, objects and bytes in the store; then the
joiner's catch-up, the same run with `--baseline-workers` for the trainer's
wait side by side, and a cost model for a 4B model and 100 workers on R2
and S3. The figures measured so far are in docs/benchmarks.md.

Simplifications, said once: the trainer shares the workers' process (and
their GIL) and pays the same latency with no bandwidth cap; behaviour
log-probs are made up, so the quarantine and the spot checks are off
(`quarantine_factor`, `spot_rate` 0) and the DPPO gate masks what it
masks; one tokenizer and environment are shared by every worker's policy,
each worker's own model skeleton is dropped after setup.

The modules, in the order a run uses them:

- `options`: `FleetOptions`, the flags of one run;
- `wan`: `WanStore`, one client's counted, delayed view of the shared store,
  and the `Tally` every view counts into;
- `sim_worker`: the simulated worker (the real `Worker` with `Policy` for
  generation) and the fleet-wide shortcuts it runs under (one patch decode
  and one model skeleton for the whole fleet);
- `simulation`: the `Fleet` of worker threads with churn, one run
  (`run_fleet`: the trainer here, the fleet beside it, a mark per version)
  and the joiner's catch-up;
- `analysis`: per-version rows, the run's summary and the verdict against
  `TARGETS`;
- `costs`: the price tables and the cost model scaled to a 4B model;
- `render`: the text the command prints;
- `cli`: the flags and `run`, which the `colonnade bench` command calls.
"""

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
