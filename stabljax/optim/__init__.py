"""In-graph stability transforms: every one an Optax ``GradientTransformation``."""
