"""Data position: the iterators the controller moves forward and back, and Grain's saved state."""
