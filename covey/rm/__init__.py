"""Training reward models: data, the Bradley-Terry / process RM trainer, and the refresh of iterative GRPO with
replay."""
