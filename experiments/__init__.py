"""stabljax experiments: small-scale reproductions of training instabilities and remedies."""
