"""The typed run configuration: schema, YAML + command-line overrides, validation.

A run is described by one YAML file with the sections below plus `section.key=value`
overrides on the command line. Every field has a type, a default and a one-line doc (the
``description``); cross-field rules are checked at start-up, before Ray or a model is touched,
and fail with a message that says which key to change. Unknown keys are errors with the
closest valid key suggested; a key given twice in the YAML is an error (PyYAML would keep the
last), and a syntax error names the file, line and column. Every bad override, unknown key,
invalid value and broken rule found is listed, one per line of the ConfigError; numbers are
never nan or infinite. What needs registries is ``treadle.config.rules``'s, what needs files
or models ``treadle.check``'s. The fully resolved config is written to
``<trainer.output_dir>/config.yaml`` so a run directory says exactly what ran.

The schema knows nothing of Ray or torch; it is plain pydantic. The package holds one module
per section (``model``, ``data``, ``rollout``, ``reward`` and its ``judge``, ``algorithm``,
``dpo``, ``kto``, ``actor``, ``critic``, ``prime``, ``teacher`` and ``distill``,
``trainer``, ``asynchronous``, ``evaluation``), ``frozen`` (what the teacher's and the
judge's sections share), ``run`` (the
sections composed), ``rules`` (every cross-field rule: validation, ``treadle check`` and role
selection read it), ``schema`` (``Config``) and ``loader`` (YAML, overrides, dump).
"""

from treadle.config.actor import ActorConfig, LoraConfig
from treadle.config.algorithm import SETTINGS, AlgorithmConfig
from treadle.config.asynchronous import AsyncConfig
from treadle.config.base import Beta, Key, Section
from treadle.config.critic import CriticConfig
from treadle.config.data import DataConfig
from treadle.config.distill import DistillConfig, TeacherConfig
from treadle.config.dpo import DPO_KNOBS, DPOConfig
from treadle.config.evaluation import EvalConfig
from treadle.config.judge import JudgeConfig
from treadle.config.kto import KTOConfig
from treadle.config.loader import dump_config, load_config
from treadle.config.model import ModelConfig
from treadle.config.prime import PrimeConfig
from treadle.config.reward import RewardConfig
from treadle.config.rollout import RolloutConfig
from treadle.config.schema import Config
from treadle.config.trainer import LoggerName, TrainerConfig

__all__ = [
    "DPO_KNOBS",
    "SETTINGS",
    "ActorConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "Beta",
    "Config",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DistillConfig",
    "EvalConfig",
    "JudgeConfig",
    "KTOConfig",
    "Key",
    "LoggerName",
    "LoraConfig",
    "ModelConfig",
    "PrimeConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "TeacherConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
]
