"""A gs:// run directory on fake-gcs-server (``tests/gcs.py``): Orbax, the controller, the
report, and the bucket requests a step makes."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
from etils import epath


def test_orbax_saves_and_restores_on_the_emulator(gcs_emulator):
    mark = gcs_emulator.mark()
    directory = epath.Path("gs://bkt/orbax-check")
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(directory, options=options) as mgr:
        for s in range(3):
            mgr.save(s, args=ocp.args.StandardSave({"w": np.arange(4.0) + s}))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        got = mgr.restore(2, args=ocp.args.StandardRestore({"w": np.zeros(4)}))
    np.testing.assert_array_equal(got["w"], np.arange(4.0) + 2)
    requests = gcs_emulator.requests(mark)
    assert any(r.startswith("POST /upload/storage/v1/b/bkt/o") for r in requests), requests[:20]
