"""Checkpoints: the Orbax store, what a checkpoint holds, its seal, retention, the run's files."""
