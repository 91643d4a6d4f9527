"""The rollback controller on several hosts: one JAX process per host, one run directory.

``python examples/multihost.py [--dir DIR] [--steps N]`` starts 2 local processes (gloo CPU
collectives, 2 CPU devices each), as a TPU pod has one process per host; each runs
:func:`train`, the code a pod host would run (docs/guides/tpu.md). The model is a linear
regression sharded data-parallel over the 4 devices; batch 25 is poisoned on process 1's
shard only, so the global loss spikes and both processes roll back together. ``DIR`` may be
``gs://bucket/dir`` (with the ``gcs`` extra); by default a new local temporary directory.
Each process prints one line; the two lines must agree.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np

ROWS, BAD = 16, 25


def train(directory: str, steps: int, process_id: int, port: int) -> str:
    """One host's training job: joins the others, trains under the controller."""
    import flax.struct
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import stabljax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, rows = (
        NamedSharding(mesh, PartitionSpec()),
        NamedSharding(mesh, PartitionSpec("data")),
    )

    @flax.struct.dataclass
    class State:
        step: jax.Array
        w: jax.Array

    @jax.jit
    def train_step(state, batch):
        def loss_fn(w):
            return jnp.mean((batch["x"] * w - batch["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(state.w)
        return State(state.step + 1, state.w - 0.1 * g), {"loss": loss}

    def host_batch(i: int) -> dict[str, np.ndarray]:  # this host's half of global batch i
        x = np.random.default_rng(i).normal(size=ROWS).astype(np.float32)
        x = x[process_id * ROWS // 2 : (process_id + 1) * ROWS // 2]
        y = 2.0 * x + (50.0 if process_id == 1 and i == BAD else 0.0)
        return {"x": x, "y": y}

    def put(x):
        return jax.make_array_from_callback(np.shape(x), replicated, lambda idx: np.asarray(x)[idx])

    def step(state, local):
        batch = {k: jax.make_array_from_process_local_data(rows, v) for k, v in local.items()}
        return train_step(state, batch)

    state = State(put(np.int32(0)), put(np.float32(0.0)))
    detectors = [stabljax.SpikeDetector(warmup=5)]
    with stabljax.RollbackController(
        directory, save_every=10, rollback_margin=5, detectors=detectors
    ) as ctl:
        state, data = ctl.run(
            step, state, stabljax.IndexedBatches(host_batch), steps, progress=False
        )
    w = float(np.asarray(state.w.addressable_data(0)))
    line = (
        f"step={ctl.current_step} w={w:.6f} skipped={ctl.skipped_ranges} rollbacks={ctl.rollbacks}"
    )
    jax.distributed.shutdown()
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default=None, help="the run directory (default: a new temp dir)")
    p.add_argument("--steps", type=int, default=40, help="steps to train")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.process_id is not None:
        print(train(args.dir, args.steps, args.process_id, args.port), flush=True)
        return 0
    directory = args.dir or tempfile.mkdtemp(prefix="stabljax-multihost-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", directory]
    cmd += ["--steps", str(args.steps), "--port", str(port)]
    procs = [
        subprocess.Popen([*cmd, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    lines = [proc.communicate(timeout=600)[0].strip().splitlines() for proc in procs]
    codes = [proc.returncode for proc in procs]
    for i, (code, out) in enumerate(zip(codes, lines, strict=True)):
        print(f"process {i} (exit {code}): {out[-1] if out else ''}")
    same = bool(lines[0]) and lines[0][-1:] == lines[1][-1:]
    print(f"run directory: {directory}; the processes agree: {same}")
    return 0 if all(c == 0 for c in codes) and same else 1


if __name__ == "__main__":
    sys.exit(main())
