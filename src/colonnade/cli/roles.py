"""`colonnade trainer` and `colonnade worker`: the two roles of a run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .envargs import add_env_arg, env_kwargs


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        help="run prefix: a directory, file:///dir or s3://bucket/prefix (or `store` in --config)",
    )
    p.add_argument("--endpoint-url", help="S3 endpoint (R2, MinIO, SeaweedFS); default AWS")
    p.add_argument("--config", type=Path, help="TOML file of settings (flags override it)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    p.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (0: any)"
    )


def register(sub: argparse._SubParsersAction) -> None:
    _register_trainer(sub)
    _register_worker(sub)


def _register_trainer(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "trainer",
        help="update the weights from workers' rollouts and publish versions",
        description="Run the trainer: writes run.json once, publishes v0, then for each "
        "version collects rollout groups of versions >= v - max_lag, recomputes rewards, "
        "takes a GRPO step with the DPPO gate and publishes v+1 as a PULSE patch (in the "
        "background, while the next step runs). Resumes from its checkpoint when the run "
        "exists. On several GPUs (FSDP2): torchrun --nproc-per-node N -m colonnade trainer ...",
    )
    _common(t)
    t.add_argument("--preset", help="named defaults: smoke | searchqa")
    t.add_argument("--env", help="environment name or import path (default smoke)")
    add_env_arg(t)
    t.add_argument("--model", help="preset (tiny, smollm2-135m), model directory or hub name")
    t.add_argument("--max-versions", type=int, help="stop after publishing this version")
    t.add_argument("--max-lag", type=int, help="oldest usable rollout: v - max_lag (0: on-policy)")
    t.add_argument("--precision", choices=["int8", "bf16"], help="of published weights")
    t.add_argument(
        "--device",
        choices=["auto", "cuda", "mps", "cpu"],
        help="where the trainer computes (default auto: CUDA, then MPS, then CPU); under "
        "torchrun each rank takes the GPU of its local rank",
    )
    t.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        help="compute precision (default auto: bf16 on CUDA, fp32 elsewhere); bf16 keeps "
        "fp32 master weights and Adam states",
    )
    t.add_argument(
        "--grad-ckpt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="activation checkpointing of every decoder layer (default: on for CUDA)",
    )
    t.add_argument("--micro-tokens", type=int, help="padded tokens per micro-batch (default 8192)")
    t.add_argument(
        "--retain-all",
        action="store_true",
        default=None,
        help="keep every rollout, ledger and version (for audits); by default what no "
        "step or joiner can use any more is deleted",
    )
    t.add_argument(
        "--fsdp",
        action="store_true",
        default=None,
        help="FSDP2 on a single process too: bf16 copies of one layer at a time instead of "
        "the whole model (always on under torchrun with 2+ ranks)",
    )
    t.add_argument("--lr", type=float, help="AdamW learning rate")
    t.add_argument("--group-size", type=int, help="episodes per task (G)")
    t.add_argument("--groups-per-step", type=int, help="groups per optimizer step")
    t.add_argument("--checkpoint-every", type=int, help="versions between checkpoints")
    t.add_argument("--anchor-every", type=int, help="versions between full anchors (K)")
    t.add_argument(
        "--worker-keys",
        help="registered workers' public keys: a .pub file or a directory of them; "
        "batches must then be signed (re-read every step)",
    )
    t.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        default=None,
        help="refuse to continue a run found under the prefix",
    )
    t.add_argument(
        "--takeover",
        action="store_true",
        default=None,
        help="resume even if another trainer's heartbeat is fresh (it is dead)",
    )
    t.set_defaults(handler=_trainer)


def _register_worker(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser(
        "worker",
        help="generate rollouts for a run (everything else comes from run.json)",
        description="Run a rollout worker: follows the newest published weights, generates "
        "groups of episodes with the int8 engine and uploads them. Stops when the run is "
        "done, or on SIGTERM / Ctrl-C after the batch in flight.",
    )
    _common(w)
    w.add_argument("--id", help="worker name (default: host-pid)")
    w.add_argument("--device", help="cpu | cuda | mps | auto (default cpu; torch engine)")
    w.add_argument(
        "--engine",
        choices=["auto", "torch", "mlx"],
        help="rollout engine (default auto: MLX on Apple silicon when installed, else torch)",
    )
    w.add_argument("--max-batches", type=int, help="stop after this many uploads")
    w.add_argument("--key", help="private key file from `colonnade keys new` (signs batches)")
    w.set_defaults(handler=_worker)


def _need_store(cfg) -> None:
    from .main import CliError

    if not cfg.store:
        raise CliError("no store given: pass --store or set `store` in the --config file")


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _trainer(args: argparse.Namespace) -> int:
    from colonnade.config import load_config
    from colonnade.protocol import ProtocolMismatch
    from colonnade.train.presets import PRESETS
    from colonnade.train.trainer import RunConflict, Trainer, TrainerConfig

    from .main import CliError

    _logging(args.log_level)
    preset = {}
    if args.preset:
        if args.preset not in PRESETS:
            raise CliError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[args.preset]
    flags = {
        k: getattr(args, k)
        for k in (
            "store",
            "endpoint_url",
            "env",
            "model",
            "max_versions",
            "max_lag",
            "precision",
            "device",
            "dtype",
            "grad_ckpt",
            "micro_tokens",
            "fsdp",
            "retain_all",
            "lr",
            "group_size",
            "groups_per_step",
            "checkpoint_every",
            "anchor_every",
            "resume",
            "takeover",
            "metrics_port",
            "worker_keys",
        )
    }
    # Bad settings (unknown env or model, wrong types) are the user's and
    # get one line; an error once training runs keeps its traceback.
    extra = env_kwargs(args)
    try:
        cfg = load_config(TrainerConfig, args.config, base=preset, **flags)
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


def _worker(args: argparse.Namespace) -> int:
    from colonnade.config import load_config
    from colonnade.rollout.mlx_engine import MlxUnavailable
    from colonnade.protocol import ProtocolMismatch
    from colonnade.rollout.worker import Quarantined, Worker, WorkerConfig

    from .main import CliError

    _logging(args.log_level)
    flags = {
        k: getattr(args, k)
        for k in (
            "store",
            "endpoint_url",
            "id",
            "device",
            "engine",
            "max_batches",
            "metrics_port",
            "key",
        )
    }
    try:
        cfg = load_config(WorkerConfig, args.config, **flags)
        _need_store(cfg)
        worker = Worker(cfg)
    except (ValueError, MlxUnavailable) as e:
        raise CliError(str(e)) from None
    try:
        return worker.run()
    # No run.json within join_timeout; refused; a run of another protocol version.
    except (TimeoutError, Quarantined, ProtocolMismatch) as e:
        raise CliError(str(e)) from None


def register_keys(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="worker signing keys (ed25519)")
    ksub = k.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = ksub.add_parser(
        "new",
        help="make a worker's key pair",
        description="Write ID.key (private, mode 0600: stays on the worker) and ID.pub "
        "(give it to the operator, who passes the file or its folder to "
        "`colonnade trainer --worker-keys`).",
    )
    new.add_argument("--id", required=True, help="the worker's name in the run")
    new.add_argument("--out", type=Path, default=Path("keys"), help="folder (default ./keys)")
    new.set_defaults(handler=_keys_new)


def _keys_new(args: argparse.Namespace) -> int:
    from colonnade.protocol.signing import new_keypair

    from .main import CliError

    try:
        private, public = new_keypair(args.id, args.out)
    except (ValueError, FileExistsError) as e:
        raise CliError(str(e)) from None
    print(f"private key: {private} (keep it on the worker: --key {private})")
    print(f"public key:  {public} (register it: colonnade trainer --worker-keys {public.parent})")
    return 0
