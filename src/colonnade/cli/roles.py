"""`colonnade trainer` and `colonnade worker`: the two roles of a run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .envargs import add_env_arg, env_kwargs


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])


def _settings(p: argparse.ArgumentParser, cls: type) -> list[str]:
    """One flag per field of the role's config (help from the field's docs)."""
    from colonnade.config import add_flags

    group = p.add_argument_group("settings", "each is also a key of the --config file")
    return add_flags(group, cls)


def register(sub: argparse._SubParsersAction) -> None:
    _register_trainer(sub)
    _register_worker(sub)


def _register_trainer(sub: argparse._SubParsersAction) -> None:
    from colonnade.config import TRAINER_PRESETS, TrainerConfig

    t = sub.add_parser(
        "trainer",
        usage="colonnade trainer --store URL [--preset NAME] [--config FILE] [--SETTING VALUE ...]",
        help="update the weights from workers' rollouts and publish versions",
        description="Run the trainer: writes run.json once, publishes v0, then for each "
        "version collects rollout groups of versions >= v - max_lag, recomputes rewards, "
        "takes a GRPO step with the DPPO gate and publishes v+1 as a PULSE patch (in the "
        "background, while the next step runs). Resumes from its checkpoint when the run "
        "exists. On several GPUs (FSDP2): torchrun --nproc-per-node N -m colonnade trainer ...",
    )
    _common(t)
    t.add_argument(
        "--preset",
        choices=list(TRAINER_PRESETS),
        help="named defaults (the file and flags beat it)",
    )
    add_env_arg(t)
    t.set_defaults(handler=_trainer, setting_dests=_settings(t, TrainerConfig))


def _register_worker(sub: argparse._SubParsersAction) -> None:
    from colonnade.config import WorkerConfig

    w = sub.add_parser(
        "worker",
        usage="colonnade worker (--join STRING | --store URL) [--config FILE] "
        "[--SETTING VALUE ...]",
        help="generate rollouts for a run (everything else comes from run.json)",
        description="Run a rollout worker: follows the newest published weights, generates "
        "groups of episodes with the int8 engine and uploads them. Stops when the run is "
        "done, or on SIGTERM / Ctrl-C after the batch in flight. --join takes the string "
        "`colonnade invite` prints (the store, its endpoint, the trainer's key); credentials "
        "come from the environment or --profile either way.",
    )
    _common(w)
    w.set_defaults(handler=_worker, setting_dests=_settings(w, WorkerConfig))


def _need_store(cfg, flags: str = "--store") -> None:
    from .main import CliError

    if not cfg.store:
        raise CliError(f"no store given: pass {flags} or set `store` in the --config file")


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _trainer(args: argparse.Namespace) -> int:
    from colonnade.config import TRAINER_PRESETS, TrainerConfig, flag_values, load_config
    from colonnade.protocol import ProtocolMismatch
    from colonnade.train.trainer import RunConflict, Trainer

    from .main import CliError

    _logging(args.log_level)
    if args.preset and args.preset not in TRAINER_PRESETS:
        raise CliError(
            f"unknown preset {args.preset!r}; choose one of {', '.join(TRAINER_PRESETS)}"
        )
    preset = TRAINER_PRESETS[args.preset] if args.preset else {}
    # Bad settings (unknown env or model, wrong types, out of range) are the
    # user's and get one line; an error once training runs keeps its traceback.
    extra = env_kwargs(args)
    try:
        cfg = load_config(
            TrainerConfig, args.config, base=preset, **flag_values(args, args.setting_dests)
        )
        cfg.env_kwargs = {**cfg.env_kwargs, **(extra or {})}  # key by key over the file's
        _need_store(cfg)
        trainer = Trainer(cfg)
    except (ValueError, FileNotFoundError) as e:
        raise CliError(str(e)) from None
    trainer.install_stop()
    try:
        trainer.run()
    except (RunConflict, ProtocolMismatch) as e:  # ProtocolMismatch: run.json of another release
        raise CliError(str(e)) from None
    return 0


def _threads(n: int) -> None:
    """torch's intra-op threads (0: leave its default). MLX has no such
    setting (on a Mac it computes on the GPU)."""
    if n:
        import torch

        torch.set_num_threads(n)


def _worker(args: argparse.Namespace) -> int:
    from colonnade.config import WorkerConfig, flag_values, load_config
    from colonnade.engine import BackendUnavailable, UnsupportedArchitecture
    from colonnade.operate.join import apply_join
    from colonnade.protocol import ProtocolMismatch
    from colonnade.rollout.pipeline import GroupError
    from colonnade.rollout.worker import Quarantined, worker_for

    from .main import CliError

    _logging(args.log_level)
    try:
        cfg = apply_join(
            load_config(WorkerConfig, args.config, **flag_values(args, args.setting_dests))
        )
        _need_store(cfg, "--join (from `colonnade invite`) or --store")
        _threads(cfg.threads)
        worker = worker_for(cfg)
    except (ValueError, BackendUnavailable) as e:
        raise CliError(str(e)) from None
    try:
        return worker.run()
    # No run.json within join_timeout; refused; a run of another protocol version;
    # a model the chosen engine does not run; a pipeline group the run cannot have.
    except (TimeoutError, Quarantined, ProtocolMismatch, UnsupportedArchitecture,
            GroupError) as e:  # fmt: skip
        raise CliError(str(e)) from None


def register_keys(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="signing keys of workers and the trainer (ed25519)")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = ksub.add_parser(
        "new",
        help="make a key pair (a worker's, or the trainer's with --id trainer)",
        description="Write ID.key (private, mode 0600: stays on its machine) and ID.pub. "
        "A worker gives its .pub to the operator, who passes the file or its folder to "
        "`colonnade trainer --worker-keys`; the trainer's key goes to `colonnade trainer "
        "--key`, and its .pub or fingerprint to `colonnade worker --trust`.",
    )
    new.add_argument("--id", required=True, help="the worker's name in the run, or trainer")
    new.add_argument("--out", type=Path, default=Path("keys"), help="folder (default ./keys)")
    new.set_defaults(handler=_keys_new)
    fp = ksub.add_parser(
        "fingerprint",
        help="print a key file's fingerprint",
        description="Print the fingerprint (SHA256:...) of a .key or .pub file: what "
        "`colonnade worker --trust` takes, and what the trainer logs at start.",
    )
    fp.add_argument("file", type=Path, help="a .key or .pub file")
    fp.set_defaults(handler=_keys_fingerprint)


def _keys_fingerprint(args: argparse.Namespace) -> int:
    from colonnade.protocol.signing import fingerprint, load_public

    from .main import CliError

    try:
        _, public = load_public(args.file)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(fingerprint(public))
    return 0


def _keys_new(args: argparse.Namespace) -> int:
    from colonnade.protocol.signing import new_keypair

    from .main import CliError

    try:
        private, public = new_keypair(args.id, args.out)
    except (ValueError, FileExistsError) as e:
        raise CliError(str(e)) from None
    if args.id == "trainer":
        print(f"private key: {private} (keep it on the trainer: --key {private})")
        print(f"public key:  {public} (workers pin it: colonnade worker --trust {public})")
        return 0
    print(f"private key: {private} (keep it on the worker: --key {private})")
    print(f"public key:  {public} (register it: colonnade trainer --worker-keys {public.parent})")
    return 0
