"""Test configuration: every test and doctest sees 8 virtual CPU devices.

The device count must be fixed before JAX initialises its backends, so it is set
here, at import time, before any test module imports jax.numpy.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except (AttributeError, RuntimeError):  # older jax, or backend already up: XLA_FLAGS covers it
    pass
