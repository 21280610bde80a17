"""The one typed config: schema (every field with its docstring), loading (presets, YAML,
key=value overrides) and checks. No torch."""

from covey.config.schema import (CHOICES, POSITIVE, SECTIONS, AlgoConfig, Config, ConfigError, ModelConfig,  # noqa: F401
                                 OptimConfig, RewardConfig, RMConfig, RolloutConfig, TaskConfig, TrainConfig,
                                 as_dict, derived_sizes, describe_keys, field_docs, from_dict, leaf_keys, load_config,
                                 set_value, split_config, uses_critic, validate, validate_world)
