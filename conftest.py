"""Test configuration: every test and doctest sees 8 virtual CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time, before any test module imports jax.numpy.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
# XLA:CPU aborts the process (SIGABRT) when a device thread waits at a collective longer
# than this (default 40 s). A deadlock then fails in 2 minutes, while a device that lags
# its peers by less on two loaded cores does not; subprocesses inherit the flag. The hang
# CI met was a deadlock, not lag: see BUILD.md, "Bounded dispatch".
if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
    _flags += " --xla_cpu_collective_call_terminate_timeout_seconds=120"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older jax, or backend already up: XLA_FLAGS covers it
    pass
