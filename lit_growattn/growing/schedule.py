"""Old path of the schedules, now `lit_growattn.callback.schedule` and (AutoSchedule) `lit_growattn.callback.budget`:
kept so that imports and configs naming it still work."""

from lit_growattn.callback.budget import AutoSchedule
from lit_growattn.callback.schedule import (
    AtEpochs, AtSteps, Clock, GrowthPoint, GrowthSchedule, check_same_schedule, warn_past_the_end,
)

__all__ = ["AtEpochs", "AtSteps", "AutoSchedule", "Clock", "GrowthPoint", "GrowthSchedule", "check_same_schedule",
           "warn_past_the_end"]
