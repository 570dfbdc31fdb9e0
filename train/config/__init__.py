"""Typed configuration: one JSON file holds DeepSpeed's keys plus this project's section `qwen_edit`.

Everything is validated before any model loads, and every problem is reported in one `ConfigError`
that names each key and its fix. A knob lives in one place: precision, micro-batch, gradient
accumulation, clipping, optimizer and LR schedule are DeepSpeed's keys; the rest is ours.

schema: the sections and their field docs; checks: ranges and combinations; deepspeed: DeepSpeed's keys;
files: readers of the side files a config names; textfile: text inputs read as an editor shows them;
load: reading, overriding, checking and writing a config.
"""

from train.config.deepspeed import DEEPSPEED_KEYS, resolve_deepspeed
from train.config.load import (
    ParallelCheck,
    explicit_keys,
    inference_settings,
    load_config,
    parse_args,
    to_dict,
    write_resolved,
)
from train.config.schema import (
    PROJECT_KEY,
    Config,
    ConfigError,
    DataConfig,
    InferenceConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    OutputConfig,
    ParallelConfig,
    ProjectConfig,
    TrainConfig,
    ValidationConfig,
    field_docs,
)

__all__ = [
    "DEEPSPEED_KEYS", "PROJECT_KEY", "Config", "ConfigError", "DataConfig", "InferenceConfig", "LoraConfig",
    "MemoryConfig", "ModelConfig", "OutputConfig", "ParallelCheck", "ParallelConfig", "ProjectConfig", "TrainConfig",
    "ValidationConfig", "explicit_keys", "field_docs", "inference_settings", "load_config", "parse_args",
    "resolve_deepspeed", "to_dict", "write_resolved",
]
