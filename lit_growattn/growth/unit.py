"""A growable unit: what the growth maths and the callback ask of a thing whose head size grows. Its two
implementations are the query/key form (`form.FormShape`: w_q, w_k, log_tau) and the value map
(`value.ValueShape`: w_v, w_o); everything above them handles a list of both through these members, without asking
which is which. (One operation is a type table instead, `sides.growth_for`: the growths import the units.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lit_growattn.growth.sketch import SketchSize, TestMatrices
    from lit_growattn.growth.stats import Sums

HeadSize = Literal["d_head", "d_v"]  # which head size a column widens (query/key or value): its key in an event record


class GrowableUnit:
    """Sizes read off the unit's tensors, and what growing it needs. A plain base class, not an ABC: the attention
    modules mix it with nn.Module."""

    side: ClassVar[HeadSize]

    # Read off the unit's tensors by each implementation:
    n_head: int
    n_kv_head: int
    e_in: int
    width: int  # what a growth widens: the unit's head size
    max_width: int  # the largest useful head size

    @property
    def column_cost(self) -> int:
        """The cache values per token one more column costs: one per KV head (the K cache of a query/key form's key
        heads under GQA, the V cache of a value map's value heads)."""
        return self.n_kv_head

    @property
    def leading_tensor(self) -> Tensor:
        """W_Q or W_V: where the unit's dtype and device are read."""
        raise NotImplementedError

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        """The parameter names a growth of the unit replaces (what its `set_weights` takes)."""
        raise NotImplementedError

    def held_weights(self):  # FormWeights | ValueWeights: both modules import this one
        """The weights the unit holds now (the same tensors, not copies): its FormWeights or ValueWeights."""
        raise NotImplementedError

    def empty_sums(self, method: str, dtype: torch.dtype = torch.float32, sketch: SketchSize | None = None,
                   seed: int = 0, tests: TestMatrices | None = None) -> Sums:
        """Empty sums for the unit's statistics: the full ones, or with `sketch` a sketch of that size whose test
        matrices are drawn from `seed`, or are `tests` (another sketch's of that seed, shared) (growth.sketch; the
        method then only matters to the growth, which refuses pinv)."""
        raise NotImplementedError

    def sums_numel(self, method: str, sketch: SketchSize | None = None) -> int:
        """The elements of the unit's statistics for `method`, or of its sketch of size `sketch` (docs/value.md,
        growth.stats, growth.sketch), without the two scalars instances and weight."""
        raise NotImplementedError

    def tests_numel(self, sketch: SketchSize | None) -> int:
        """The elements of the test matrices a sketch of size `sketch` draws beside its sums (growth.sketch; each
        sketch's, which AutoSchedule's half of the window shares with the whole); 0 without a sketch. Only asked
        under sketched statistics (contract.SketchCapture). Memory that the
        statistics window holds as long as the sums (`callback.memory`)."""
        raise NotImplementedError
