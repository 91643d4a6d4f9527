"""Detection: spike, divergence and drift detectors, trend tests, the monitor running them."""
