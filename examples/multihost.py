"""Training on several hosts under one RollbackController: a TPU pod, or 2 processes here.

Every process runs :func:`train` with the same arguments. On a TPU pod each VM is one
process: ``jax.distributed.initialize()`` with no arguments finds the others, and the
run directory is a bucket (``gs://bucket/run``), since the hosts share no disk. On this
machine, ``python examples/multihost.py`` starts 2 processes of 2 CPU devices each, joined
with gloo collectives, each in its own working directory, and checks that they agree.

What the example shows (the operator guide, docs/guides/tpu.md, explains each):

- one mesh over every device of every process, the state replicated over it and the batch
  split along ``"data"``; :meth:`~stabljax.control.RollbackController.restore_or_init`
  restores each leaf with the sharding of the state passed in;
- data indexed by the global step: batch ``i`` is the same global batch on every host, and
  each host feeds its own rows of it, so a skipped range ``[a, b)`` means the same steps on
  every host;
- a window of poisoned batches (``--bad``) that makes every process roll back together;
- a hand-written loop that drives itself by the controller's step (a rollback moves it
  back) and closes the controller in ``finally``: ``Preempted`` is a ``SystemExit``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile

import numpy as np

BATCH, SEQ = 32, 64  # the global batch: rows split over all devices


def _poison(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A shard of zero bytes, a byte no text holds: the loss jumps far above its level."""
    return {**batch, "targets": np.zeros_like(batch["targets"])}


def train(directory: str, *, steps: int, bad: tuple[int, ...] = (), seed: int = 0) -> dict:
    """Trains the reference LM to ``steps`` under a controller in ``directory``.

    Call it in every process after ``jax.distributed.initialize``. Returns what process
    ``jax.process_index()`` saw: its final step, loss, rollbacks and skipped ranges.
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import stabljax
    from stabljax.reference import (
        VOCAB_SIZE,
        TransformerConfig,
        TransformerLM,
        default_corpus,
        lm_batch_fn,
    )

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("data"))
    me, hosts = jax.process_index(), jax.process_count()

    cfg = TransformerConfig(vocab_size=VOCAB_SIZE, d_model=32, n_layers=2, n_heads=2, max_len=SEQ)
    apply_fn, params = stabljax.nnx_apply(TransformerLM(cfg, rngs=nnx.Rngs(seed)))
    optimizer = stabljax.skip_nonfinite(optax.adamw(3e-3))
    state = stabljax.TrainState.create(params, optimizer)

    def put(x):  # the same host value in every process -> one global array
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, replicated, lambda index: x[index])

    state = jax.tree.map(put, jax.device_get(state))
    train_step = stabljax.make_train_step(stabljax.lm_loss(apply_fn), optimizer)

    global_batch = lm_batch_fn(default_corpus(200_000), batch_size=BATCH, seq_len=SEQ, seed=seed)

    def local_batch(i: int) -> dict[str, np.ndarray]:
        """This host's rows of global batch ``i`` (poisoned if ``i`` is in ``bad``)."""
        batch = _poison(global_batch(i)) if i in bad else global_batch(i)
        share = BATCH // hosts
        return {k: v[me * share : (me + 1) * share] for k, v in batch.items()}

    ctl = stabljax.RollbackController(directory, save_every=10, keep=3, rollback_margin=5)
    try:
        state, data = ctl.restore_or_init(state, stabljax.IndexedBatches(local_batch))
        metrics = None
        while ctl.current_step < steps:  # a rollback moves the step back: train to a target
            local = next(data)
            batch = {k: jax.make_array_from_process_local_data(rows, v) for k, v in local.items()}
            state, metrics = train_step(state, batch)
            state, data = ctl.step(state, metrics, data)
        state, data = ctl.finish(state, data)
    finally:
        ctl.close()  # a preemption (a SystemExit) or an error: no save left in flight
    loss = float(np.asarray(metrics["loss"].addressable_data(0))) if metrics else None
    return {
        "process": me,
        "step": ctl.current_step,
        "loss": loss,
        "rollbacks": ctl.rollbacks,
        "skipped_ranges": [list(r) for r in ctl.skipped_ranges],
    }


def _indices(text: str) -> list[int]:
    """``"30-37"`` or ``"3,5"`` -> a list of batch indices."""
    if "-" in text:
        first, last = (int(v) for v in text.split("-"))
        return list(range(first, last + 1))
    return [int(v) for v in text.split(",") if v]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace) -> int:
    """Starts ``args.processes`` processes of this script, each in its own working
    directory, waits for them, and checks that they agree."""
    port, procs, outs = _free_port(), [], []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    here = pathlib.Path(__file__).resolve()
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), env.get("PYTHONPATH", "")])
    for i in range(args.processes):
        cwd = tempfile.mkdtemp(prefix=f"host{i}-")  # no shared working directory
        outs.append(pathlib.Path(cwd) / "result.json")
        cmd = [sys.executable, str(here), "--dir", args.dir, "--steps", str(args.steps)]
        cmd += ["--bad", ",".join(map(str, args.bad)), "--process-id", str(i)]
        cmd += ["--processes", str(args.processes), "--port", str(port), "--out", str(outs[-1])]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env))
    codes = [p.wait(timeout=args.timeout) for p in procs]
    if any(codes):
        print(f"processes exited with {codes}", file=sys.stderr)
        return 1
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        print(json.dumps(r))
    agree = all({**r, "process": 0} == {**results[0], "process": 0} for r in results)
    print("processes agree" if agree else "processes DISAGREE")
    return 0 if agree else 1


def _worker(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.process_id,
    )
    result = train(args.dir, steps=args.steps, bad=tuple(args.bad))
    pathlib.Path(args.out).write_text(json.dumps(result))
    jax.distributed.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="run directory (gs://bucket/run on a pod); a temp dir")
    parser.add_argument("--steps", type=int, default=80, help="train to this step")
    parser.add_argument(
        "--bad",
        type=_indices,
        default=list(range(60, 68)),
        help="poisoned global batches: 'a-b' (inclusive) or comma-separated (default: 60-67)",
    )
    parser.add_argument("--processes", type=int, default=2, help="processes to start")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.process_id is not None:
        return _worker(args)
    args.dir = args.dir or tempfile.mkdtemp(prefix="multihost-run-")
    return _launch(args)


if __name__ == "__main__":
    sys.exit(main())
