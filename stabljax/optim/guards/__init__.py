"""Step guards: skip a whole update on a non-finite value or a spike, MultiSteps included."""
