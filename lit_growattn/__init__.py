"""lit_growattn: grow the query/key dimension of attention during training, from gradient statistics.

    from lit_growattn import AtEpochs, GrowAttentionCallback, GrowAttentionLM, GrowthSettings
    trainer = lightning.Trainer(callbacks=[GrowAttentionCallback(AtEpochs([2, 4]), GrowthSettings(columns=2))])
"""

import importlib

from lit_growattn.callback import (
    AtEpochs, AtSteps, AutoSchedule, GrowAttentionCallback, GrowthSchedule, GrowthSettings, StatisticsSettings, StepSearch,
)
from lit_growattn.model.config import GPTConfig
from lit_growattn.model.gpt import GPT
from lit_growattn.module import GrowAttentionLM

__all__ = [
    "AtEpochs",
    "AtSteps",
    "AutoSchedule",
    "GPT",
    "GPTConfig",
    "GrowAttentionCallback",
    "GrowAttentionLM",
    "GrowthSchedule",
    "GrowthSettings",
    "StatisticsSettings",
    "StepSearch",
]


def __getattr__(name: str):
    """The old paths of the callback's modules, which a plain `import lit_growattn` made attributes before they moved
    into `lit_growattn.callback`."""
    if name in ("callbacks", "settings", "growing"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
