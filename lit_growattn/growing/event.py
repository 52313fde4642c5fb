"""Old path of the growth event, now `lit_growattn.callback.event` and (the automatic schedule's offers)
`lit_growattn.callback.budget`: kept so that imports naming it still work."""

from lit_growattn.callback.budget import offers
from lit_growattn.callback.event import (
    GrowthEvent, LossOf, StepChoice, Stopwatch, choose_step_size, plan_growth,
)

__all__ = ["GrowthEvent", "LossOf", "StepChoice", "Stopwatch", "choose_step_size", "offers", "plan_growth"]
