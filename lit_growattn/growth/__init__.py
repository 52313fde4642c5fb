"""The maths of growing the query/key head size (pure torch; docs/design.md, sections 1–5) and the value head
size (docs/value.md).

stats      Sums, the mergeable sums' base; FormStats: sums C, N (and C⁺NC⁺ for pinv) of one form; one flat buffer
           for all forms.
solvers    directions ΔM by method name (gradient, natural, pinv; @register_direction adds one) and their normalisation.
form       FormWeights: a form's (w_q, w_k, log_tau), the one type of them; FormShape: sizes read off them.
factorize  FormGrowth: ΔM, α, d_new → W_Q′, W_K′, log τ′ (replace | append), sign check, Adam carry-over.
grouped    GroupedGrowth: the same for forms with shared keys (GQA) or rotary columns.
choices    the allowed values of every setting (one Literal each; the methods come from the registry).
step_size  step-size candidates, the choice among their losses, and the quadratic step rule.
plan       GrowthPlan: a growth event over many forms, as the Lightning callback drives it.
allocation the automatic schedule's rule: held-out gain of each candidate column per cache value, bought
           across layers and sides within an allowance.
unit       GrowableUnit: what a growable unit (query/key form or value map) offers, so that everything above handles
           lists of both; HeadSize, the side a column widens.
sides      what the callback does with either side: column costs, restore, sums from a checkpoint; growth_for, a
           type table.
value      the value side: W_M = W_V W_O per head, its sums (ValueStats) and appended columns (ValueGrowth).
sketch     sketched statistics: e′·k numbers per head instead of e′² (range and co-range sketches, Nyström C_V), the
           test matrices drawn from a seed.
sketched   the growths of both sides from the sketch's thin factors.
shrink     the closest form or value map of a smaller head size (truncated SVD, whitened by the activations'
           covariance when given), GQA groups stacked, rotary columns kept; per-layer sizes under a KV budget.
linalg     float64 helpers: pseudo-inverse, ridge inverse and roots with explicit cut-offs, bases, projections, the
           SVD of a thin product, canonical pair signs.
"""

from lit_growattn.growth.choices import (
    BASELINES, LINE_SEARCHES, METHODS, MODES, SECOND_MOMENT_POLICIES, SIDES, TEMPERATURES, TRUNCATIONS, Baseline,
    Direction, LineSearch, Method, Mode, SecondMoment, Side, STEP_RULES, StepRule, Temperature, Truncation, check_choice,
)
from lit_growattn.growth.factorize import Carry, FormGrowth, Growth, Outcome, sizing_method
from lit_growattn.growth.form import FormShape, FormWeights
from lit_growattn.growth.grouped import GroupedGrowth
from lit_growattn.growth.plan import GrowthPlan, installed
from lit_growattn.growth.sides import HeadSize, column_costs, growth_for, restore, stats_from_state_dict
from lit_growattn.growth.sketch import (
    SketchFormStats, SketchMoments, SketchSize, SketchValueMoments, SketchValueStats, TestMatrices,
)
from lit_growattn.growth.sketched import SketchedFormGrowth, SketchedGroupedGrowth, SketchedValueGrowth
from lit_growattn.growth.solvers import DIRECTIONS, direction, register_direction
from lit_growattn.growth.stats import FormStats, Moments, NonFiniteStatistics, Sums, flatten_stats, unflatten_stats
from lit_growattn.growth.value import VALUE_METHODS, GrownValue, ValueGrowth, ValueStats, ValueWeights
from lit_growattn.growth.unit import GrowableUnit
from lit_growattn.growth.step_size import candidate_steps, choose_step, loss_rounding, quadratic_step

__all__ = [
    "BASELINES",
    "Baseline",
    "Direction",
    "LineSearch",
    "Method",
    "Mode",
    "SECOND_MOMENT_POLICIES",
    "SecondMoment",
    "SIDES",
    "Side",
    "Temperature",
    "Truncation",
    "check_choice",
    "Carry",
    "DIRECTIONS",
    "FormGrowth",
    "FormShape",
    "FormWeights",
    "FormStats",
    "GroupedGrowth",
    "GrowableUnit",
    "GrownValue",
    "Growth",
    "GrowthPlan",
    "LINE_SEARCHES",
    "METHODS",
    "MODES",
    "Moments",
    "NonFiniteStatistics",
    "Outcome",
    "STEP_RULES",
    "StepRule",
    "SketchFormStats",
    "SketchMoments",
    "SketchSize",
    "SketchValueMoments",
    "SketchValueStats",
    "SketchedFormGrowth",
    "SketchedGroupedGrowth",
    "SketchedValueGrowth",
    "Sums",
    "TEMPERATURES",
    "TRUNCATIONS",
    "TestMatrices",
    "VALUE_METHODS",
    "ValueGrowth",
    "ValueStats",
    "ValueWeights",
    "candidate_steps",
    "choose_step",
    "loss_rounding",
    "direction",
    "flatten_stats",
    "growth_for",
    "installed",
    "quadratic_step",
    "register_direction",
    "sizing_method",
    "unflatten_stats",
    "HeadSize",
    "column_costs",
    "restore",
    "stats_from_state_dict",
]
