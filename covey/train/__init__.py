"""covey.train(config, reward_funcs=None, reward_weights=None, tools=None, environment_factory=None): train a
policy as `config` (covey.load_config) says and return a TrainResult (run folder, held-out accuracy before and
after, metrics). reward_funcs: TRL-style callables or "module:function[:weight]" strings; tools: functions the
model may call, or one function; environment_factory: a class (one instance per episode) or a dict of them by
name, as TRL 1.16 takes them. The full text: help(covey.train.api.train); docs/your-task.md, docs/agents.md.

The package holds the run:
- api: `covey.train`, the Python API of a whole run;
- plan: Config -> Plan, once at the top of a run; plan_checks: the checks that read covey.algos' registries;
- loop: open_run -> steps -> finish, in the order it runs; setup: everything a run builds before its first
  step; inputs: the tools, environments and model family a run brings, checked before the model loads;
- rollout_phase: sample, score and refill a step's groups; token_weights: the sampler correction and token
  selections, decided once per rollout; step_metrics: what a step reports about its samples and memory;
- update: the optimisation phase (`optimizer_steps`) every learner feeds; dpo: iterative DPO's update;
  optim: the optimizers, their state and the learning-rate schedule; router_aux: the router's
  load-balancing loss of a mixture of experts;
- global_batch: what makes several ranks compute one global batch; memory_fit: the GPU memory budget's fit
  check and the batch sizes fitted to it;
- checkpoint: atomic checkpoints and exact resume; evaluate: held-out evaluation; gradvar: the variance of
  the policy-gradient estimate; signal_watch: steps without learning signal, said out loud.

`covey.train` is both this package and the function that trains (covey.train.api.train). A package is a
module object, and a module object cannot be called; binding the function to the name `covey.train` instead
would lose the package, and the import system binds the package back onto that name as soon as any
submodule (`covey.train.loop`) is imported. So this module's class is swapped for a ModuleType subclass
whose `__call__` runs covey.train.api.train: `covey.train(cfg)` trains, and `covey.train.loop` is still a
module. The API module is imported on the first call (as `covey` imports this package), so
`covey.train.plan` alone loads no model code.
"""

import importlib
import sys
import types


class CallablePackage(types.ModuleType):
    """The `covey.train` package, callable as covey.train.api.train."""

    def __call__(self, config, reward_funcs=None, reward_weights=None, tools=None, environment_factory=None):
        """Train a policy as `config` says (covey.train.api.train)."""
        return importlib.import_module("covey.train.api").train(config, reward_funcs, reward_weights, tools,
                                                                environment_factory)


sys.modules[__name__].__class__ = CallablePackage
