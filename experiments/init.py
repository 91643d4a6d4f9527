"""Alias: ``python -m experiments.init`` runs :mod:`experiments.init_schemes`."""

import sys

from experiments.init_schemes import main

if __name__ == "__main__":
    main(sys.argv[1:])
