"""torch.compile of the transformer blocks, kept valid (and its recompiles bounded) across growth events.

Dynamo keeps one cache per code object, and every block runs the same `Block.forward`. With static shapes
(`dynamic=False`) that cache holds one graph per distinct block: per-layer head sizes and per-layer constants
(DIFF's λ_init) both tell layers apart, and so does each input shape (the shorter last batch of an epoch).
So a model holds at most 2 · n_layer graphs, the recompile limit is set to that, and hitting it fails loudly
instead of running the blocks eagerly from then on (dynamo's default, announced by a single warning).

A growth event replaces the query/key parameters with wider ones. Guards would then compile new graphs beside
the stale ones, until the limit is hit. Instead the blocks' parameter signature is checked before each compiled
call, and when it changed all compiled code is dropped (`torch.compiler.reset`, process-wide) and each block
compiles again: at most 2 · n_layer compilations per growth event.
"""

from __future__ import annotations

import torch
import torch._dynamo.exc
from torch import Tensor, nn


def parameter_signature(modules: nn.Module) -> tuple:
    return tuple((name, p.shape, p.dtype, p.device) for name, p in modules.named_parameters())


class CompiledBlocks:
    """Compiled twins of `blocks` (a plain object, not a submodule: parameters and state_dict keys stay as they
    are). Used for training steps only; see `GPT.forward`."""

    def __init__(self, blocks: nn.ModuleList):
        if torch.torch_version.TorchVersion(torch.__version__) < "2.6":
            raise RuntimeError(f"compile: true needs torch ≥ 2.6 (dynamo's recompile limit that fails), found "
                               f"{torch.__version__}; upgrade torch or set compile: false")
        self.blocks = blocks
        self.compiled = [torch.compile(block, dynamic=False, fullgraph=True) for block in blocks]
        self.signature = None  # taken at the first call: moving the model to its device is not a growth
        self.resets = 0

    def __call__(self, x: Tensor) -> Tensor:
        signature = parameter_signature(self.blocks)
        if self.signature is not None and signature != self.signature:
            torch.compiler.reset()  # the graphs of the old shapes would otherwise stay cached
            self.resets += 1
        self.signature = signature
        limit = self.graphs_bound
        try:
            with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
                for block in self.compiled:
                    x = block(x)
        except torch._dynamo.exc.FailOnRecompileLimitHit as err:
            raise RuntimeError(
                f"compile: the transformer blocks needed more than {limit} compiled graphs (one per layer and input "
                "shape, two input shapes at most): feed batches of at most two shapes (fixed sequence length), or "
                "set compile: false"
            ) from err
        return x

    @property
    def graphs_bound(self) -> int:
        """Most graphs the blocks may hold at once: one per layer for full batches, one for the last batch."""
        return 2 * len(self.blocks)
