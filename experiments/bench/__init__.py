"""stabljax benchmarks: the cost of the stability measures against plain Optax."""
