"""The one typed config: schema (every field with its docstring), loading (packaged presets named
on the command line, YAML files, key=value overrides) and checks. No torch of its own; what an
estimator needs is read from the traits of covey.algos.ESTIMATORS."""

from covey.config.checks import (CHOICES, CORRUPTION_KINDS, MULTISTEP_OPS, POSITIVE, WORD_MAX_STEPS,  # noqa: F401
                                 derived_sizes, parse_corruptions, uses_critic, validate, validate_template,
                                 validate_world, value_of)
from covey.config.load import (as_dict, config_yaml, from_dict, load_config, preset_file, preset_names,  # noqa: F401
                               preset_path, read_preset, set_value, split_config)
from covey.config.describe import describe_keys, field_docs  # noqa: F401
from covey.config.schema import (SECTIONS, AlgoConfig, Config, ConfigError, EvalConfig, ModelConfig,  # noqa: F401
                                 OptimConfig, RewardConfig, RMConfig, RolloutConfig, TaskConfig, TrainConfig,
                                 leaf_keys)
