"""covey's benchmarks against TRL's GRPOTrainer: one harness, its workloads, three drivers.

Run from the repository root, e.g. `python -m bench.speed --steps 6 --runs covey,trl`:

- `harness`: one subprocess per trainer run (its memory is its own), interleaved rounds, step
  summaries, the machine's matmul peak and copy bandwidth, a FLOP counter, result files;
- `workloads`: what is run (the CPU workload, the Qwen-shaped GPU workloads, the learning workload
  with its stop rule and evaluation points) and the reward both trainers score with;
- drivers: `speed` (CPU step time vs TRL), `gpu` (one GPU: step time, memory, decode vs its floor),
  `learn` (what both learn from the same settings); `report` turns their results into tables;
- trainer-side children: `covey_side` (covey through its public step API, `open_run` / `steps` /
  `finish`, with module hooks on `session.run.policy`; `decode` times its decode loop) and
  `trl_side` (GRPOTrainer, with the covey-config -> TRL-settings mapping).

Nothing here assigns to an attribute of a covey module; TRL comes from the `bench` extra.
"""
