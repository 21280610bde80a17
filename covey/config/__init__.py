"""The one typed config: schema (every field with its docstring), loading (packaged presets named
on the command line, YAML files, key=value overrides) and the checks a config can make alone.
No torch and no covey.algos: the algorithm names and what an estimator needs are checked from the
registries' traits when the run's plan is made (covey/train/plan_checks.py)."""

from covey.config.checks import (CHOICES, CORRUPTION_KINDS, MULTISTEP_OPS, POSITIVE, WORD_MAX_STEPS,  # noqa: F401
                                 check_choices, parse_corruptions, validate, validate_template,
                                 validate_world, value_of)
from covey.config.load import (as_dict, config_yaml, from_dict, load_config, preset_file, preset_names,  # noqa: F401
                               preset_path, read_preset, set_value, split_config)
from covey.config.describe import describe_keys, field_docs  # noqa: F401
from covey.config.schema import (SECTIONS, AlgoConfig, Config, ConfigError, EvalConfig, ModelConfig,  # noqa: F401
                                 OptimConfig, RewardConfig, RMConfig, RolloutConfig, TaskConfig, TrainConfig,
                                 leaf_keys)
