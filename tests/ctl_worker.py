"""The controller tests' training job, run as a script: the toy problem of tests/toy.py
under a RollbackController, so tests can SIGKILL it and restart it, or run it as two real
JAX processes (``--process-id``, gloo collectives, 2 CPU devices each).

    python tests/ctl_worker.py --dir D --steps 120 --bad 35,36,80 --out final.npz
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import numpy as np
from toy import ROWS, batch_fn_factory, controller_kwargs, ints, make_toy


def _train(args) -> int:
    import jax

    from stabljax.control import IndexedBatches, RollbackController

    state, train_step = make_toy(extra=args.extra, donate=args.background)
    signals = {"term": signal.SIGTERM, "int": signal.SIGINT}
    ctl = RollbackController(
        args.dir,
        **controller_kwargs(
            save_every=args.save_every,
            keep=args.keep,
            fast_every=args.fast_every,
            async_save=not args.sync,
            background_save=args.background,
            preemption_signals=[signals[s] for s in args.signals.split(",") if s],
        ),
    )
    batch_fn = batch_fn_factory(ints(args.bad))
    state, data = ctl.restore_or_init(state, IndexedBatches(batch_fn))
    print("ready", flush=True)  # the signal handlers are in place
    if args.run:
        with ctl:
            state, data = ctl.run(train_step, state, data, args.steps, progress=False)
        if ctl.last_run.preempted:
            with open(args.out + ".preempted.json", "w") as f:
                json.dump({"step": ctl.last_run.step, "reached": ctl.last_run.reached}, f)
            return 0
    while ctl.current_step < args.steps:
        state, metrics = train_step(state, next(data))
        state, data = ctl.step(state, metrics, data)
        if args.kill_at_save and ctl.events.count("save") >= args.kill_at_save:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.kill_at_rollback and ctl.rollbacks >= args.kill_at_rollback:
            os.kill(os.getpid(), signal.SIGKILL)  # right after the rollback: record, deletes
        if args.kill_at_step and ctl.current_step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # the save of this step is in flight
        if args.raise_at_step and ctl.current_step == args.raise_at_step:
            raise RuntimeError("the loop dies, and nobody calls close()")
        if ctl.current_step >= args.steps:
            state, data = ctl.finish(state, data)
    ctl.close()
    host = jax.device_get(state.params)
    np.savez(args.out, w=host["w"], b=host["b"], step=int(state.step))
    with open(args.out + ".json", "w") as f:
        json.dump({"ranges": ctl.skipped_ranges, "index": data.index}, f)
    return 0


def _join_two_processes(args):
    """gloo collectives, 2 processes x 2 CPU devices; ``(replicated, rows, put, local_batch)``.

    ``rows`` splits a leading axis over the 4 devices, ``put(x, sharding)`` makes a global
    array of a host value, and ``local_batch(i)`` is this process's half of batch ``i``
    (only process 1's half of a ``--bad`` batch is poisoned).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=2,
        process_id=args.process_id,
    )
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    poisoned, me, clean = set(ints(args.bad)), jax.process_index(), batch_fn_factory()

    def put(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    def local_batch(i: int):
        b = clean(i)
        half = {k: v[me * ROWS // 2 : (me + 1) * ROWS // 2] for k, v in b.items()}
        if me == 1 and i in poisoned:
            half["y"] = half["y"] + 50.0
        return half

    rows = NamedSharding(mesh, PartitionSpec("data"))
    return NamedSharding(mesh, PartitionSpec()), rows, put, local_batch


def _multi(args) -> int:
    import jax

    from stabljax.control import IndexedBatches, RollbackController

    replicated, rows, put, local_batch = _join_two_processes(args)
    state, train_step = make_toy()
    state = jax.tree.map(lambda x: put(x, replicated), jax.device_get(state))

    def global_batch(local):
        return {k: jax.make_array_from_process_local_data(rows, v) for k, v in local.items()}

    ctl = RollbackController(args.dir, **controller_kwargs())
    state, data = ctl.restore_or_init(state, IndexedBatches(local_batch))
    state, data = ctl.run(
        lambda s, b: train_step(s, global_batch(b)), state, data, args.steps, progress=False
    )
    ctl.close()
    params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), state.params)
    np.savez(
        args.out, w=params["w"], b=params["b"], step=int(np.asarray(state.step.addressable_data(0)))
    )
    rollbacks = [
        {"step": e.step, "restored": e.details["restored_step"]}
        for e in ctl.events
        if e.kind == "rollback"
    ]
    with open(args.out + ".json", "w") as f:
        json.dump({"ranges": ctl.skipped_ranges, "index": data.index, "rollbacks": rollbacks}, f)
    jax.distributed.shutdown()
    return 0


def _fsdp(args) -> int:
    """Two processes x 2 devices, params and Adam moments sharded over all 4 devices.

    A hand-written loop, so a test can SIGKILL both processes at a step (``--kill-at-step``)
    or have process 0 SIGTERM itself right after the save of step ``--term-at`` (once
    ``--term-rollbacks`` rollbacks have happened), both processes then pausing so that
    the notice arrives while neither has gone on. Writes ``OUT`` (the gathered params),
    ``OUT.json`` (ledger) or ``OUT.preempted.json``.
    """
    import time

    import jax
    import optax
    from jax.experimental import multihost_utils

    from stabljax.control import IndexedBatches, Preempted, RollbackController

    replicated, rows, put, local_batch = _join_two_processes(args)
    me = jax.process_index()
    state, train_step = make_toy(optax.adam(0.05))

    def layout(x):  # FSDP: every leaf with a leading axis of 4 is split over the devices
        return rows if np.ndim(x) and np.shape(x)[0] % 4 == 0 else replicated

    shardings = jax.tree.map(layout, state)

    state = jax.tree.map(put, jax.device_get(state), shardings)
    assert not state.params["w"].is_fully_addressable
    step_fn = jax.jit(train_step, out_shardings=(shardings, replicated))
    ctl = RollbackController(args.dir, **controller_kwargs())
    state, data = ctl.restore_or_init(state, IndexedBatches(local_batch))
    termed = False
    try:
        while ctl.current_step < args.steps:
            batch = {
                k: jax.make_array_from_process_local_data(rows, v) for k, v in next(data).items()
            }
            state, metrics = step_fn(state, batch)
            state, data = ctl.step(state, metrics, data)
            if ctl.current_step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if (
                not termed
                and ctl.current_step == args.term_at
                and ctl.rollbacks >= args.term_rollbacks
            ):
                termed = True
                if me == 0:
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(3.0)  # the notice arrives while both processes wait here
            if ctl.current_step >= args.steps:
                state, data = ctl.finish(state, data)
    except Preempted as e:
        ctl.close()
        with open(args.out + ".preempted.json", "w") as f:
            json.dump({"step": e.step, "saved": e.saved, "rollbacks": ctl.rollbacks}, f)
        jax.distributed.shutdown()
        return 0
    ctl.close()
    params = multihost_utils.process_allgather(state.params, tiled=True)
    np.savez(
        args.out,
        w=params["w"],
        b=params["b"],
        step=int(np.asarray(state.step.addressable_data(0))),
    )
    with open(args.out + ".json", "w") as f:
        json.dump(
            {"ranges": ctl.skipped_ranges, "index": data.index, "rollbacks": ctl.rollbacks}, f
        )
    jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--bad", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--extra", type=int, default=0, help="ballast floats (slower saves)")
    p.add_argument("--sync", action="store_true", help="synchronous saves")
    p.add_argument("--background", action="store_true", help="background_save, donating step")
    p.add_argument("--kill-at-save", type=int, default=0, help="SIGKILL self after N saves")
    p.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL self at this step")
    p.add_argument("--kill-at-rollback", type=int, default=0, help="SIGKILL after N rollbacks")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--fast-every", type=int, default=None, help="the fast tier (host RAM)")
    p.add_argument("--raise-at-step", type=int, default=0, help="raise (no close) at this step")
    p.add_argument("--run", action="store_true", help="train with ctl.run (preemptible)")
    p.add_argument("--signals", default="term", help="preemption signals: term,int")
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="2 processes, state sharded over 4")
    p.add_argument("--term-at", type=int, default=-1, help="SIGTERM after this save (fsdp)")
    p.add_argument("--term-rollbacks", type=int, default=0, help="... once this many rollbacks")
    args = p.parse_args(argv)
    if args.fsdp:
        return _fsdp(args)
    if args.process_id is not None:
        return _multi(args)
    return _train(args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
