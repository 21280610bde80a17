"""covey's benchmarks against TRL's GRPOTrainer: one harness, its workloads, the trainer sides, the drivers.

Run from the repository root, e.g. `python -m bench.speed --steps 6 --runs covey,trl`:

- `harness`: trainer runs as child processes under a time budget, interleaved rounds, step medians and
  rates, the machine's peaks, a FLOP counter, the report files; `report`: the tables and verdicts;
- `workloads`: what is run (the CPU, GPU and capacity workloads, memory setups, the random Qwen2 models,
  the learning runs' stop rule and evaluation points) and the reward both trainers score with;
- trainer sides, one role per child: `covey_side` (covey through its public step API, `open_run` / `steps`
  / `finish`, hooks on `session.run.policy`, the clock around public calls) and `trl_side` (GRPOTrainer,
  with the covey-config -> TRL-settings mapping);
- drivers: `speed` (CPU step time vs TRL), `gpu` (one GPU: step time, memory, decode vs its floor),
  `gpu_capacity` (what fits under a memory cap), `learn` (what both learn from the same settings),
  `gpu_learn` (the GPU learning check's restore and summary), `episodes` (the cost of a tool turn),
  `optim_memory` (bytes per parameter of each optimizer).

Nothing here assigns to an attribute of a covey object or reads a private one; TRL comes from the `bench` extra.
"""
