"""The triage tests' training job, run as a script: the toy problem of tests/toy.py with
triage on, its spikes constructed (``--bad``: data, ``--trigger``: state; see toy.py).

It optionally SIGKILLs itself during triage (``--kill-in-triage K``: at the K-th replayed
step), and writes the final params, ledger and events for the test to compare:

    python tests/triage_worker.py --dir D --bad 35 --out final.npz [--kill-in-triage 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from toy import ints, kill_at, triage_batches, triage_controller_kwargs, triage_toy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--bad", default="")
    p.add_argument("--trigger", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--kill-in-triage", type=int, default=0, help="SIGKILL at this replayed step")
    args = p.parse_args(argv)

    import jax

    from stabljax.control import IndexedBatches, RollbackController, TriageConfig

    hook = kill_at(args.kill_in_triage) if args.kill_in_triage else None
    state, train_step = triage_toy()
    batch_fn = triage_batches(ints(args.bad), ints(args.trigger))
    config = TriageConfig(_fault_hook=hook)
    ctl = RollbackController(args.dir, triage=config, **triage_controller_kwargs())
    with ctl:
        state, data = ctl.run(
            train_step, state, IndexedBatches(batch_fn), args.steps, progress=False
        )
    host = jax.device_get(state.params)
    np.savez(args.out, w=host["w"], b=host["b"], step=int(state.step))
    with open(args.out + ".json", "w") as f:
        json.dump({"ranges": ctl.skipped_ranges, "index": data.index}, f)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
