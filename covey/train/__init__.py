"""The RL run: plan, loop, setup, update, iterative DPO, global batch, checkpoints, evaluation, gradient variance.

`covey.train` is both this package and the function that trains: `covey.train(cfg, reward_funcs=...)`
(covey.train.api.train). A package is a module object, and a module object cannot be called; binding
the function to the name `covey.train` instead would lose the package, and the import system binds
the package back onto that name as soon as any submodule (`covey.train.loop`) is imported. So this
module's class is swapped for a ModuleType subclass whose `__call__` runs covey.train.api.train:
`covey.train(cfg)` trains, and `covey.train.loop` is still a module.
"""

import sys
import types

from covey.train import api


class CallablePackage(types.ModuleType):
    """The `covey.train` package, callable as covey.train.api.train."""

    def __call__(self, config, reward_funcs=None):
        return api.train(config, reward_funcs)

    __call__.__doc__ = api.train.__doc__


sys.modules[__name__].__class__ = CallablePackage
