"""Process plumbing with no RL in it.

- dist: processes and collectives; fsdp: FSDP2 sharding and whole-tensor views of sharded models;
- precision: where bfloat16 is native; cpu: torch threads and glibc malloc settings;
- memory: peak GPU memory per phase, batch sizes fitted to the budget, out-of-memory retries;
  budget: the arithmetic of the GPU memory budget;
- signals: graceful stop on SIGINT / SIGTERM, and the fault tests' kill points;
- metrics: metrics.jsonl and samples.jsonl; loggers: the experiment trackers of train.logger (trackio,
  Weights & Biases, TensorBoard) that get the same lines; errors: one-line error text;
- http: the common part of covey's JSON-over-HTTP servers (replies, timeouts, the bearer token).
"""
