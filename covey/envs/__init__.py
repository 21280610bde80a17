"""Environment sources that drive covey's engine from outside: each turns its trajectories into covey's episode
rows (the model's tokens trained, the environment's tokens attended) (docs/environments.md).

- rows: an episode's recorded server calls as one episode row (the first call's prompt, each completion the
  model's with its log-probs, the ids a later prompt adds the environment's), refused where a call does not
  extend the last; rows as a Rollout;
- served: episodes played from outside against a policy server (covey/serve/) started on the run's engine
  for each batch: their seeds, their calls into rows, their outcomes counted (failed, timed out, dropped);
- harness: agent harnesses (`task.source=harness:<command>`): the command run per episode, given its row, its
  reward line;
- verifiers: a verifiers 0.4 environment (`task.source=verifiers:<taskset>`): its taskset's tasks as the
  rows, its episodes run against the server, G per row, its weighted reward and its parts;
- openenv: an OpenEnv environment's `reset`/`step` client wrapped as covey's environment
  (`task.source=openenv:<module or local server URL>`), run by the tool loop.
"""
