"""GPU capacity (scripts/gpu_capacity.sh): the capacity grid of bench/gpu.py, `python -m bench.gpu_capacity --help`."""
from bench.gpu import main

if __name__ == "__main__":
    raise SystemExit(main(capacity=True))
