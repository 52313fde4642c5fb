"""What GrowAttentionCallback needs of a LightningModule, and of the growable forms and value maps it holds.

A model not built here (a Hugging Face causal LM, say) needs an adapter that meets these protocols, nothing
else. The callback checks them in `setup`, as Lightning's BackboneFinetuning checks for `backbone`, and refuses
with a message naming what is missing before any training work is done.

Shapes: a form has `n_head` query heads and `n_kv_head` key heads (n_head when every query head has its own key;
under GQA the query heads of group g = j // (n_head // n_kv_head) share key head g). W_Q is (n_head, e′, d_head),
W_K (n_kv_head, e′, d_head), log τ (n_head,); e′ = input size + 1 when the form has a bias (X′ = [X | 1]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping, NamedTuple, Protocol, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

CaptureMode = Literal["extend", "explicit"]


@runtime_checkable
class Resizable(Protocol):
    """A module whose parameters a grown checkpoint may have widened (a score map, a value map): resized before
    the checkpoint loads, and its bias rows kept out of weight decay."""

    def resize_to(self, state_dict: Mapping[str, Tensor], prefix: str) -> None:
        """Takes the head size its tensors have in `state_dict` (keys `prefix + parameter name`), with placeholder
        values that loading the state dict then fills; nothing when its keys are absent."""
        ...

    def bias_row_parameters(self) -> list[nn.Parameter]:
        """The (h, e′, ·) parameters whose last row along e′ is a bias (multiplies X′'s constant column): they get
        no weight decay on that row. Empty without a bias."""
        ...


@runtime_checkable
class ScoreMap(Resizable, Protocol):
    """A softmax score map whose head size a checkpoint may change (every growable form is one; so is a map that
    never grows but is loaded from a grown checkpoint, such as low-rank DINT's second map)."""

    @property
    def d_head(self) -> int: ...


@runtime_checkable
class Unit(Protocol):
    """What the callback asks of a form or value map whatever its side: the members of
    `lit_growattn.growth.GrowableUnit`, which `FormShape` and `ValueShape` implement (inherit one of them)."""

    side: str  # "d_head" (query/key) or "d_v" (value)
    e_in: int
    width: int
    max_width: int

    @property
    def column_cost(self) -> int: ...

    @property
    def leading_tensor(self) -> Tensor: ...

    def tensor_names(self) -> tuple[str, ...]: ...

    def held_weights(self) -> Any: ...

    def empty_sums(self, method: str, dtype: Any = ...) -> Any:
        """Zeroed sums of the unit's statistics for `method`, in `dtype`. With the sketch off the callback calls it
        with these arguments only; sketched statistics also pass `sketch=`, `seed=` and `tests=`, see
        `SketchCapture`."""
        ...

    def sums_numel(self, method: str) -> int:
        """The numbers `empty_sums(method)` holds (the memory estimate); called with `sketch=` only under sketched
        statistics, see `SketchCapture`."""
        ...


@runtime_checkable
class GrowableForm(ScoreMap, Unit, Protocol):
    """A query/key bilinear form M_j = τ_j W_Qj W_K(g(j))ᵀ that growth widens (see the module docstring for shapes).

    Its w_q, w_k and log_tau are the fields of `lit_growattn.growth.FormWeights`, the one type of a form's weights
    (what growth computes and `set_weights` takes); inheriting `lit_growattn.growth.FormShape` gives n_head,
    n_kv_head, d_head and the members of `Unit`, as QKForm and the Hugging Face GrowableAttention do.

    Sketched statistics (`statistics.sketch`) also need the attribute `sketch` (`SketchCapture`): None by default;
    the statistics window sets it, with `capture`, for a statistics step to the `growth.sketch.TestMatrices` of the
    form's `growth.SketchFormStats` (`"omega"` (e′, k), `"psi"` (n_head, e′, l)). While it is set `take_captured`
    returns the triples (X′ (b, s, e′), G_j X′Ω (b, n_head, s, k), Σ_{j∈g} G_jᵀX′Ψ_j (b, n_kv_head, s, l)), the
    positional arguments of `SketchFormStats.update`, with G = ∂L/∂S the score gradient, and scores, outputs and
    gradients stay as they are (`lit_growattn.attention.sketch`).
    """

    w_q: Tensor  # (n_head, e′, d_head)
    w_k: Tensor  # (n_kv_head, e′, d_head)
    log_tau: Tensor  # (n_head,)
    capture: CaptureMode | None  # set by the statistics window; None: plain attention

    @property
    def n_head(self) -> int: ...

    @property
    def n_kv_head(self) -> int:
        """Key heads; n_head // n_kv_head query heads share each (n_head when there is no grouping)."""
        ...

    def take_captured(self) -> list[tuple[Tensor, ...]]:
        """The (X′ (b, s, e′), G·X′ (b, h, s, e′)) pairs recorded on backward passes since the last call (with
        `sketch` set, the triples of `SketchFormStats.update`, see above)."""
        ...

    def set_weights(self, w_q: Tensor, w_k: Tensor, log_tau: Tensor) -> None:
        """Replaces the parameters by new ones (possibly another d_head); new Parameter objects."""
        ...


@runtime_checkable
class GrowableValues(Resizable, Unit, Protocol):
    """A value map W_M,j = W_V,j//g W_O,j per head that value growth widens (docs/value.md). Its w_v and w_o are the
    fields of `lit_growattn.growth.ValueWeights`; inheriting `lit_growattn.growth.value.ValueShape` gives n_head,
    n_kv_head, e_in, e_out, d_v and the members of `Unit`, as `lit_growattn.attention.value.ValueMap` does.

    Sketched statistics also need the attribute `sketch` (`SketchCapture`): None by default; the statistics window sets
    it, with `capture`, to the `growth.sketch.TestMatrices` of the map's `growth.SketchValueStats` (`"omega"`
    (n_head, e, k), `"psi"` (e′, l), `"omega_c"` (e′, k_c)). While it is set `take_captured` returns the tuples
    (X′ (b, s, e′), Σ_{j∈g} A_jᵀG_YΩ_j (b, n_kv_head, s, k), A_jX′Ψ (b, n_head, s, l), G_Y = ∂L/∂Y (b, s, e),
    A_jᵀA_jX′Ω_c (b, n_head, s, k_c)), the positional arguments of `SketchValueStats.update`; the last is not borne
    by the loss's gradient (a GradScaler does not scale it)."""

    w_v: Tensor  # (n_kv_head, e′, d_v)
    w_o: Tensor  # (n_head, d_v, e)
    capture: Any  # set by the statistics window; falsy: plain attention

    @property
    def d_v(self) -> int: ...

    def take_captured(self) -> list[tuple[Tensor, ...]]:
        """The (A·X′ (b, H, s, e′), ∂L/∂Y (b, s, e)) pairs recorded on backward passes since the last call (with
        `sketch` set, the tuples of `SketchValueStats.update`, see above)."""
        ...

    def set_weights(self, w_v: Tensor, w_o: Tensor) -> None:
        """Replaces the parameters by new ones (possibly another d_v); new Parameter objects."""
        ...


@runtime_checkable
class SketchCapture(Protocol):
    """What a growable form or value map needs besides `Unit` only for sketched statistics (`statistics.sketch`); a
    unit without it is refused under `on`, and `auto` keeps the full statistics for it. With the sketch off none of
    this is used. `FormShape` and `ValueShape` implement the methods; the attribute is the capture's (see
    `GrowableForm`, `GrowableValues`):

    - `sketch`: growth.sketch.TestMatrices | None, set by the statistics window; None: the full capture;
    - `empty_sums(method, dtype, sketch=, seed=, tests=)`: the sketch's empty sums, of size `sketch`
      (`growth.SketchSize`), its test matrices drawn from `seed`, or `tests` (another sums' of that seed, shared);
    - `sums_numel(method, sketch=)`: the numbers those sums hold; `tests_numel(sketch)`: those of their test
      matrices (the memory estimate).
    """

    sketch: Any

    def empty_sums(self, method: str, dtype: Any = ..., sketch: Any = ..., seed: int = ...,
                   tests: Any = ...) -> Any: ...

    def sums_numel(self, method: str, sketch: Any = ...) -> int: ...

    def tests_numel(self, sketch: Any) -> int: ...


class NamedForm(NamedTuple):
    """A growable form, its layer (0-based) and its qualified name relative to the LightningModule, so that
    `f"{name}.w_q"` is a key of `pl_module.named_parameters()` and of the optimizer state carried over."""

    layer: int
    name: str
    form: GrowableForm


@runtime_checkable
class GrowableModule(Protocol):
    """What GrowAttentionCallback needs of the LightningModule it grows (GrowAttentionLM implements it).

    Besides these methods: one optimizer from `configure_optimizers` (a growth rebuilds it through
    `trainer.strategy.setup_optimizers` with the same parameter groups), and `load_state_dict` resizing
    the forms to a checkpoint's shapes first (`ScoreMap.resize_to`), so that a grown checkpoint loads.
    """

    def growable_forms(self) -> list[NamedForm]:
        """Every form that may grow, layer by layer; a layer without forms does not grow."""
        ...

    def head_sizes(self) -> list[int]:
        """The query/key head size of every layer (all forms of a layer share it); its length is the layer count."""
        ...

    def batch_loss(self, batch: Any) -> Tensor:
        """The mean training loss (scalar) of one batch as the train dataloader yields it, already on the module's
        device; called under `torch.no_grad()` in eval mode to rate candidate growths."""
        ...

    def record_head_sizes(self) -> None:
        """Records the current `head_sizes()` where the module is rebuilt from (hparams), after each growth, so that
        `load_from_checkpoint` builds the grown sizes."""
        ...


@runtime_checkable
class ValueGrowingModule(Protocol):
    """What GrowAttentionCallback needs besides `GrowableModule` to grow the value side (`growth.grow`: value or
    both); `record_head_sizes` then records the value sizes too."""

    def growable_values(self) -> list[NamedForm]:
        """Every value map that may grow (`GrowableValues`), layer by layer, named like the forms."""
        ...

    def value_sizes(self) -> list[int]:
        """The value head size of every layer."""
        ...


@runtime_checkable
class ShardableModule(Protocol):
    """What growth under FSDP2 (Lightning's ModelParallelStrategy) needs besides `GrowableModule`: the transformer
    blocks, FSDP2's unit of sharding, and a way to build one anew, since a growth replaces the blocks it widens
    instead of editing them (`lit_growattn.training.fsdp2`)."""

    def blocks(self) -> nn.ModuleList:
        """The transformer blocks, the block of layer i at index i (a growth assigns its new block there)."""
        ...

    def build_block(self, layer: int) -> nn.Module:
        """A new block of `layer` as the module was built (its initial head sizes; loading a block's state resizes it,
        as loading a grown checkpoint does: `Resizable.resize_to`), on the current default device."""
        ...

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's mixed-precision policy, with which the blocks and the module are sharded at `configure_model`, and
        each block a growth rebuilds is sharded again."""
        ...


def check_shardable(pl_module: object) -> None:
    """Raises TypeError naming what a module to grow under FSDP2 lacks."""
    if lacks := missing(pl_module, ShardableModule):
        raise TypeError(
            f"{type(pl_module).__name__} cannot grow under ModelParallelStrategy (FSDP2): it lacks {', '.join(lacks)} "
            "(lit_growattn.contract.ShardableModule), as GrowAttentionLM and hf.HFCausalLM have; train it with "
            "strategy='ddp'"
        )


def growable_units(pl_module: object) -> list[NamedForm]:
    """Every growable query/key form, then every growable value map when the module has them (`growable_values`,
    optional: a module without it grows query/key only)."""
    values = getattr(pl_module, "growable_values", None)
    return [*pl_module.growable_forms(), *(values() if values is not None else [])]


def members(protocol: type) -> list[str]:
    """The public attributes and methods a protocol declares, its bases' included."""
    names = set()
    for cls in protocol.__mro__:
        if cls is protocol or (Protocol in cls.__bases__ and cls is not Protocol):
            names |= {n for n in [*vars(cls), *getattr(cls, "__annotations__", {})] if not n.startswith("_")}
    return sorted(names)


def missing(obj: object, protocol: type) -> list[str]:
    """The members of `protocol` that `obj` lacks (empty: it has the protocol's shape)."""
    return [n for n in members(protocol) if not hasattr(obj, n)]


def check_value_module(pl_module: object) -> list[NamedForm]:
    """The module's growable value maps; raises TypeError naming what the module or a map lacks."""
    if lacks := missing(pl_module, ValueGrowingModule):
        raise TypeError(
            f"GrowAttentionCallback cannot grow the value side of {type(pl_module).__name__}: it lacks "
            f"{', '.join(lacks)} (lit_growattn.contract.ValueGrowingModule), as GrowAttentionLM "
            "has; set growth.grow='query_key', or add them to the module"
        )
    values = pl_module.growable_values()
    for named in values:
        if lacks := missing(named.form, GrowableValues):
            raise TypeError(f"value map {named.name!r} ({type(named.form).__name__}) lacks {', '.join(lacks)} of "
                            "lit_growattn.contract.GrowableValues")
    return values


def check_module(pl_module: object) -> list[NamedForm]:
    """The module's growable forms; raises TypeError naming what the module lacks, ValueError when it has no form."""
    if lacks := missing(pl_module, GrowableModule):
        raise TypeError(
            f"GrowAttentionCallback cannot grow {type(pl_module).__name__}: it lacks {', '.join(lacks)}. A module to grow "
            "implements lit_growattn.contract.GrowableModule (growable_forms, head_sizes, batch_loss, "
            "record_head_sizes), as lit_growattn.GrowAttentionLM does; wrap other models in an adapter that does"
        )
    forms = pl_module.growable_forms()
    if not forms:
        raise ValueError(
            f"{type(pl_module).__name__}.growable_forms() is empty: no attention layer has a growable query/key form "
            "(lit_growattn.contract.GrowableForm); choose an attention variant with one, or train without "
            "GrowAttentionCallback (remove it from the config's trainer.callbacks)"
        )
    for named in forms:
        if lacks := missing(named.form, GrowableForm):
            raise TypeError(f"form {named.name!r} ({type(named.form).__name__}) lacks {', '.join(lacks)} of "
                            "lit_growattn.contract.GrowableForm")
    return forms
