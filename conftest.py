"""Test configuration: every test and doctest sees 8 virtual CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time, before any test module imports jax.numpy.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# XLA:CPU aborts the process (SIGABRT) when a device thread reaches a collective more
# than 40 s after the others. Eight virtual devices on two loaded cores can lag that
# much (CI lost the main job's smoke run to it); subprocesses inherit the flag.
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older jax, or backend already up: XLA_FLAGS covers it
    pass
