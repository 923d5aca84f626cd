"""Run configuration: the schema (`schema.py`: dataclasses, one docstring a key), its validation (`validation.py`)
and its text (`toml_io.py`: TOML in and out, `--set` overrides, shipped configs by name).

`validate()` checks everything that can be checked without a process group, so that a bad value fails once, on the
launching process, with a message that names it and the fix. The names the rest of pipetune uses are here.
"""

from pipetune.config.schema import (
    DTYPES,
    MAX_LENGTH,
    MAX_TIMEOUT_S,
    QUANTIZE,
    RESUME_MODES,
    RUN_STRATEGIES,
    STRATEGIES,
    SYNTHETIC_LENGTHS,
    SYSTEM_PROMPT,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    TrainConfig,
)
from pipetune.config.toml_io import (
    DATA_SUFFIXES,
    _toml_value,
    apply_override,
    config_path,
    from_dict,
    load_config,
    save_config,
    shipped_configs,
    to_toml,
)
from pipetune.config.validation import _check_schedule, check_stage_count, validate, validate_against_model
from pipetune.errors import ConfigError

__all__ = [
    "DATA_SUFFIXES",
    "DTYPES",
    "MAX_LENGTH",
    "MAX_TIMEOUT_S",
    "QUANTIZE",
    "RESUME_MODES",
    "RUN_STRATEGIES",
    "STRATEGIES",
    "SYNTHETIC_LENGTHS",
    "SYSTEM_PROMPT",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "ParallelConfig",
    "TrainConfig",
    "_check_schedule",
    "_toml_value",
    "apply_override",
    "check_stage_count",
    "config_path",
    "from_dict",
    "load_config",
    "save_config",
    "shipped_configs",
    "to_toml",
    "validate",
    "validate_against_model",
]
