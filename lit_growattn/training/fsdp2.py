"""FSDP2 (torch's `fully_shard`, which Lightning's ModelParallelStrategy runs): sharding a growable module, and
re-sharding the blocks a growth widens (docs/design.md §13).

The unit of sharding is the transformer block (`contract.ShardableModule.blocks`); what is outside the blocks
(embeddings, final norm, head) is the root's group. A growth never edits a sharded block: parameters assigned to a
module that is already sharded are silently ignored (FSDP2 re-registers its own at the next unshard, so forward runs
at the old width), and `fully_shard` cannot be applied to a module twice. Instead the event's blocks are gathered into
plain copies holding full tensors (`GatheredBlocks`), which the growth reads, rates and grows exactly as on one
device, and which are then sharded in the old blocks' place.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal, Sequence

import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lit_growattn.contract import ShardableModule
from lit_growattn.training.checkpoint import resize_to_checkpoint

DATA_PARALLEL = "data_parallel"  # the mesh dimension ModelParallelStrategy names for data parallelism
TENSOR_PARALLEL = "tensor_parallel"

# The dtypes FSDP2 may compute in (a module's `fsdp_param_dtype`). Not float16: its gradients would need a loss
# scaler, which FSDP2's policy does not have.
FsdpParamDtype = Literal["bfloat16"]
PARAM_DTYPES = {"bfloat16": torch.bfloat16}
# The Trainer precisions that keep the weights FSDP2 shards, and the optimizer state, in float32.
PRECISIONS_WITH_FP32_WEIGHTS = ("32-true", "bf16-mixed")


def check_param_dtype(param_dtype: str | None) -> None:
    """Refuses a compute dtype FSDP2's policy is not offered with (`PARAM_DTYPES`)."""
    if param_dtype is not None and param_dtype not in PARAM_DTYPES:
        raise ValueError(f"fsdp_param_dtype must be null (no policy: compute in the weights' dtype) or one of "
                         f"{', '.join(map(repr, PARAM_DTYPES))}; got {param_dtype!r}")


def check_mixed_precision_applies(param_dtype: str | None, mesh: DeviceMesh | None, precision: str) -> None:
    """Refuses, before fit, an `fsdp_param_dtype` that would not be applied (no FSDP2 without ModelParallelStrategy's
    `mesh`), or whose float32 master weights the Trainer's `precision` would replace by low-precision ones."""
    if param_dtype is None:
        return
    if mesh is None:
        raise ValueError(f"fsdp_param_dtype={param_dtype!r} is FSDP2's mixed precision, which only "
                         "ModelParallelStrategy applies: train with strategy=ModelParallelStrategy("
                         "data_parallel_size=N, tensor_parallel_size=1), or set fsdp_param_dtype to null and "
                         "precision='bf16-mixed' (autocast) under this strategy")
    if precision not in PRECISIONS_WITH_FP32_WEIGHTS:
        raise ValueError(f"fsdp_param_dtype={param_dtype!r} keeps the sharded weights and the optimizer state in "
                         f"float32, but precision={precision!r} stores them in low precision: set precision='32-true'")


def mixed_precision_policy(param_dtype: str | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for a module's `fsdp_param_dtype`, the one place it is built: parameters all-gathered in that
    dtype for forward and backward, gradients reduced in float32 into the float32 shards that the optimizer steps.
    None: FSDP2's default, computing and reducing in the weights' own dtype."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[param_dtype], reduce_dtype=torch.float32)


def rating_precision(module: nn.Module) -> AbstractContextManager:
    """The context of a growth event's forward passes under a policy that computes in low precision: autocast to
    that dtype. The event's plain copies hold float32 weights (the master values the growth reads and installs),
    while the sharded groups around them hand on activations in the policy's dtype, which a float32 weight cannot
    multiply; autocast casts the copies' weights for each matmul as FSDP2 casts the sharded blocks', so that the
    candidates are rated at the precision training computes in."""
    param_dtype = module.fsdp_policy().param_dtype if is_sharded(module) else None
    return nullcontext() if param_dtype is None else torch.autocast(module.device.type, dtype=param_dtype)


def check_data_parallel_only(mesh: DeviceMesh) -> None:
    """Refuses a tensor-parallel dimension in ModelParallelStrategy's `mesh`: it would split the attention heads over
    ranks, and growth reads and rewrites whole heads."""
    tensor_parallel = mesh[TENSOR_PARALLEL].size()
    if tensor_parallel != 1:
        raise ValueError(f"growth under ModelParallelStrategy supports data parallelism only (FSDP2): "
                         f"tensor_parallel_size={tensor_parallel} would split attention heads across ranks; set "
                         f"tensor_parallel_size=1 and data_parallel_size={mesh.size()}")


def check_no_weight_averaging(callbacks: Sequence[Callback]) -> None:
    """Refuses Lightning's weight-averaging callbacks under ModelParallelStrategy: their averaged copy of the module
    would be a whole, unsharded module (FSDP2 cannot deep-copy a sharded one) that no growth re-shards."""
    for callback in callbacks:
        if isinstance(callback, (WeightAveraging, StochasticWeightAveraging)):
            name = type(callback).__name__
            raise ValueError(
                f"{name} cannot be combined with growth under ModelParallelStrategy yet: its averaged copy of the "
                f"module is not sharded, and a growth does not re-shard it. Use strategy='ddp' with {name}"
            )


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def shard_block(block: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    """One FSDP2 group per block: the one place a block is sharded, at `configure_model` and after each growth."""
    fully_shard(block, mesh=mesh, mp_policy=policy)


def shard_model(module: ShardableModule, mesh: DeviceMesh) -> None:
    """Shards every block of `module` on the data-parallel `mesh`, then the module itself (the root's group holds the
    rest; with no DDP under ModelParallelStrategy, it also reduces those parameters' gradients), all with the
    module's mixed-precision policy."""
    policy = module.fsdp_policy()
    for block in module.blocks():
        shard_block(block, mesh, policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)


def check_sharded_by_blocks(module: ShardableModule) -> None:
    """Refuses a module not sharded as `shard_model` leaves it, the module and each block a group of its own: a
    growth re-shards the blocks it rebuilds that way, which would silently replace any other sharding."""
    unsharded = [layer for layer, block in enumerate(module.blocks()) if not is_sharded(block)]
    if is_sharded(module) and not unsharded:
        return
    what = f"blocks {unsharded} are" if is_sharded(module) else "the module itself is"
    raise ValueError(f"growth under ModelParallelStrategy needs {type(module).__name__} sharded as its "
                     f"configure_model shards it (fully_shard on the module and on each of its blocks), but {what} not "
                     "sharded: let configure_model shard the module")


def reshard_all(module: nn.Module) -> None:
    """Registers the sharded parameters again everywhere. The root keeps its parameters unsharded after a forward
    (it expects the backward next), so after forward-only passes `named_parameters()` would name plain tensors that
    no optimizer knows."""
    for m in module.modules():
        if is_sharded(m):
            m.reshard()


def relazy(root: nn.Module) -> None:
    """Makes FSDP2 run its lazy initialisation again at the root's next forward, so that a block sharded after the
    first forward joins the root's states instead of becoming a root of its own (which would never reshard after
    forward and run the root's end-of-backward work a second time). Private API of torch 2.13's `_fully_shard`,
    kept to this one function and pinned by tests/test_fsdp2.py."""
    state = root._get_fsdp_state()
    for other in state._state_ctx.all_states:
        other._is_root = None
    state._state_ctx.all_states.clear()
    state._is_root = None


@torch.no_grad()
def plain_copy(module: ShardableModule, layer: int) -> nn.Module:
    """Block `layer` of `module` as a new plain module holding its full tensors (a collective: every rank calls it):
    built as the module was (`build_block`), on the meta device so that no initialisation is drawn or stored, then
    given the block's shapes and values. Persistent buffers come with the state dict; non-persistent ones keep the
    values `build_block` gives them (the growable blocks hold none)."""
    old = module.blocks()[layer]
    full = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in old.state_dict().items()}
    with torch.device("meta"):
        new = module.build_block(layer)
    resize_to_checkpoint(new, full)  # the path a grown checkpoint loads by: every score map and value map resized
    new.load_state_dict(full, assign=True)
    frozen = {name for name, param in old.named_parameters() if not param.requires_grad}
    for name, param in new.named_parameters():
        param.requires_grad_(name not in frozen)
    return new.train(old.training)


class GatheredBlocks:
    """The blocks of `layers` as plain copies with full tensors, in place of the sharded ones, while a growth event
    plans (it reads the units' weights), rates candidates (installed in the units, which a sharded block would
    silently undo) and grows them. Then `restore` puts the sharded blocks back (on leaving the `with`, unless
    `reshard` ran), and `reshard` shards the copies in their place. With no layers, or an unsharded module, it does
    nothing: the event then runs on the module as it is."""

    def __init__(self, module: ShardableModule, layers: Sequence[int]):
        self.module = module
        self.layers = list(layers) if is_sharded(module) else []
        self.sharded: dict[int, nn.Module] = {}
        self.plain: dict[int, nn.Module] = {}
        self.meshes: dict[int, DeviceMesh] = {}

    def __enter__(self) -> GatheredBlocks:
        if not self.layers:
            return self
        reshard_all(self.module)
        blocks = self.module.blocks()
        # Every copy first, then the swaps: a copy that fails (out of memory) leaves the sharded blocks in place.
        self.plain = {layer: plain_copy(self.module, layer) for layer in self.layers}
        for layer, copy in self.plain.items():
            self.meshes[layer] = next(blocks[layer].parameters()).device_mesh
            self.sharded[layer], blocks[layer] = blocks[layer], copy
        return self

    def restore(self) -> None:
        """The sharded blocks back in place, every parameter registered sharded (as the optimizer knows them)."""
        if not self.layers:
            return
        blocks = self.module.blocks()
        for layer, block in self.sharded.items():
            blocks[layer] = block
        reshard_all(self.module)

    def reshard(self) -> None:
        """The plain copies, sharded as the blocks they replace were (mesh and mixed-precision policy), in their place
        for good."""
        if not self.layers:
            return
        if not self.sharded:  # fully_shard cannot shard a module twice
            raise RuntimeError("GatheredBlocks.reshard ran twice: the grown blocks are sharded already")
        blocks, policy = self.module.blocks(), self.module.fsdp_policy()
        for layer, block in self.plain.items():
            shard_block(block, self.meshes[layer], policy)
            blocks[layer] = block
        relazy(self.module)
        self.sharded = {}

    def __exit__(self, *exc) -> None:
        self.restore()


def resize_to_shapes(module: ShardableModule, shapes: dict[str, torch.Tensor]) -> bool:
    """Gives every block of the sharded `module` the head sizes of `shapes` (a checkpoint's, by state-dict name),
    with placeholder values, so that the checkpoint then loads into it: Lightning loads a distributed checkpoint into
    the module's shapes as they are. A block that differs is gathered, resized as on one device
    (`resize_to_checkpoint`) and sharded again in its place, one block at a time (a collective: every rank calls
    it). Returns whether any block was rebuilt."""
    names = {id(block): name for name, block in module.named_modules()}
    rebuilt = False
    for layer, block in enumerate(module.blocks()):
        prefix = f"{names[id(block)]}."
        wanted = {key.removeprefix(prefix): shape for key, shape in shapes.items() if key.startswith(prefix)}
        if all(wanted.get(name, tensor).shape == tensor.shape for name, tensor in block.state_dict().items()):
            continue
        with GatheredBlocks(module, [layer]) as gathered:
            resize_to_checkpoint(gathered.plain[layer], wanted)
            gathered.reshard()
        rebuilt = True
    return rebuilt
