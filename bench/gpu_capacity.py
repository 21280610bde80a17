"""GPU capacity (scripts/gpu_capacity.sh): bench/gpu.py's capacity grid, `python -m bench.gpu_capacity --help`."""

import sys

from bench.gpu import main

if __name__ == "__main__":
    sys.exit(main(capacity=True))
