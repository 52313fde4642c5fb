"""The maths of growing the query/key head size (pure torch; DESIGN §1–§5).

stats      FormStats: mergeable sums C, N (and C⁺NC⁺ for pinv) of one form; one flat buffer for all forms.
solvers    directions ΔM by method name (gradient, natural, pinv) and their score-RMS normalisation.
factorize  FormGrowth: ΔM, α, d_new → W_Q′, W_K′, log τ′ (replace | append), sign check, Adam carry-over.
step_size  step-size candidates, the choice among their losses, and the quadratic step rule.
plan       GrowthPlan: a growth event over many forms, as the Lightning callback drives it.
"""

from lit_growattn.growth.factorize import MODES, TEMPERATURES, TRUNCATIONS, Carry, FormGrowth, Growth
from lit_growattn.growth.plan import GrowthPlan
from lit_growattn.growth.solvers import BASELINES, DIRECTIONS, METHODS, direction
from lit_growattn.growth.stats import FormStats, Moments, NonFiniteStatistics, flatten_stats, unflatten_stats
from lit_growattn.growth.step_size import LINE_SEARCHES, STEP_RULES, candidate_steps, choose_step, quadratic_step

__all__ = [
    "BASELINES",
    "Carry",
    "DIRECTIONS",
    "FormGrowth",
    "FormStats",
    "Growth",
    "GrowthPlan",
    "LINE_SEARCHES",
    "METHODS",
    "MODES",
    "Moments",
    "NonFiniteStatistics",
    "STEP_RULES",
    "TEMPERATURES",
    "TRUNCATIONS",
    "candidate_steps",
    "choose_step",
    "direction",
    "flatten_stats",
    "quadratic_step",
    "unflatten_stats",
]
