"""The RL run: plan, loop, setup, update, iterative DPO, global batch, checkpoints, evaluation, gradient variance."""
