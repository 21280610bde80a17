"""The run: its code, module by module. The function that trains is `covey.train` (covey/__init__.py), which
drives loop's open_run -> steps -> finish.

- plan: the Config turned into a Plan once (sizes, the estimator and loss options, the KL controller,
  sampling, reference, step scoring, schedule); plan_setup: the Plan's set-up sections (model, engine,
  optimizer, rewards, run, tools); plan_checks: the config against the covey.algos registries
- loop: open_run -> steps() -> finish, one step top to bottom; inputs: what a run brings besides its
  config (reward functions, tools, environments, the model's family), checked before the model loads
- setup: what open_run builds (process, run folder, models, optimizers, engines); optim: the optimizers,
  the learning-rate schedule, the KL controller; memory_fit: the GPU memory budget and the batch sizes
  fitted to it
- rollout_phase: sampling and scoring a step; partial: rows carried across steps (rollout.partial); rl: the
  advantage learner's stages (step scores, log-probs, advantages, token devices, the update);
  token_weights: what acts on single tokens before the update; update: one optimizer_steps for every
  learner; dpo: iterative DPO; sft: supervised fine-tuning (its pass of whole conversations is
  covey/passes/sequences.py); distill: on-policy distillation's teacher and update; phases: which steps
  are supervised, the teacher's options; global_batch: one global batch over torchrun's processes;
  balance: the update's rows spread over the processes by tokens; gradvar: gradient variance;
  signal_watch: steps without learning signal; router_aux: the routers' load-balancing loss of mixtures
  of experts; step_metrics: a step's metrics
- checkpoint: checkpoints, resume and the final model; evaluate: held-out evaluation

Nothing is imported here: `import covey` imports this package, and stays light.
"""
