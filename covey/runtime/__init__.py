"""Process plumbing with no RL in it: processes and collectives (dist), FSDP2 sharding, precision, signals, memory,
metrics files, CPU settings, error text."""
