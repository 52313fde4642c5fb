"""GrowAttentionCallback and what it runs (docs/design.md, "Lightning mechanics"):

settings     GrowthSettings, StatisticsSettings, StepSearch: every setting, its default and allowed values
schedule     when events happen: Clock, GrowthPoint, GrowthSchedule, AtEpochs, AtSteps
budget       AutoSchedule: the KV-cache budget, its allowance per check, each side's offer and cost
             (growth.allocation buys)
window       the statistics window: capture, round-robin, folding, the one all-reduce, checkpoint state
event        one growth: plan, step size, broadcast, install;  memory: statistics memory, layers per event
trainer_ops  rebuilding DDP and the optimizer;  averaging: weight-averaged copies;  report: console and TensorBoard
callback     the Lightning hooks;  checks: the checks done at setup
"""

from lit_growattn.callback.budget import AutoSchedule
from lit_growattn.callback.callback import GrowAttentionCallback
from lit_growattn.callback.schedule import AtEpochs, AtSteps, GrowthSchedule
from lit_growattn.callback.settings import GrowthSettings, StatisticsSettings, StepSearch

__all__ = [
    "AtEpochs",
    "AtSteps",
    "AutoSchedule",
    "GrowAttentionCallback",
    "GrowthSchedule",
    "GrowthSettings",
    "StatisticsSettings",
    "StepSearch",
]
