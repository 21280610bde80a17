"""The one typed config, with no torch and no covey.algos: the algorithm names and what an estimator
needs are checked from the registries' traits when the run's plan is made (covey/training/plan_checks.py).

- schema: the config's shape, one dataclass per section, every field with its docstring;
  schema_algo: the `algo` section (estimator, policy loss, KL, update, token devices);
  schema_rewards: the `reward` and `rm` sections;
- load: defaults, then packaged presets named on the command line and YAML files, then key=value
  overrides; presets/ holds the packaged preset files;
- checks: the checks a config can make alone, run when it loads, and the sizes it implies;
- describe: each field's docstring read from the source, and `covey train --help-config`;
- errors: ConfigError, the one-line error of a bad setting.
"""

from covey.config.checks import (  # noqa: F401
                                 CHOICES,
                                 CORRUPTION_KINDS,
                                 MULTISTEP_OPS,
                                 POSITIVE,
                                 WORD_MAX_STEPS,
                                 check_choices,
                                 parse_corruptions,
                                 validate,
                                 validate_template,
                                 validate_world,
                                 value_of,
)
from covey.config.describe import describe_keys, field_docs  # noqa: F401
from covey.config.load import (  # noqa: F401
                                 as_dict,
                                 config_yaml,
                                 from_dict,
                                 load_config,
                                 preset_file,
                                 preset_names,
                                 preset_path,
                                 read_preset,
                                 set_value,
                                 split_config,
)
from covey.config.schema import (  # noqa: F401
                                 LOGGERS,
                                 SECTIONS,
                                 AlgoConfig,
                                 Config,
                                 ConfigError,
                                 EvalConfig,
                                 ModelConfig,
                                 OptimConfig,
                                 PartialConfig,
                                 RewardConfig,
                                 RMConfig,
                                 RolloutConfig,
                                 TaskConfig,
                                 TrainConfig,
                                 leaf_keys,
                                 parse_loggers,
                                 parse_source,
)
