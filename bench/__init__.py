"""covey's benchmarks against TRL's GRPOTrainer, run from the repository root (`python -m bench.speed ...`):
`harness`: child processes under a time budget, interleaved rounds, medians and rates, the machine's peaks,
report files; `workloads`: what is run and the learning runs' schedule; `covey_side` / `trl_side`: the two
trainers' roles in a child (covey through open_run / steps / finish, TRL with covey's settings mapped);
drivers: `speed` (CPU), `gpu` (one GPU), `gpu_capacity` (what fits under a memory cap), `learn` (what both
learn), `gpu_learn` (the GPU learning check's restore and summary), `episodes` (a tool turn's cost),
`optim_memory` (bytes per parameter of each optimizer). Nothing here assigns to a covey object's attributes."""
