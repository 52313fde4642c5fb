"""A growth direction and an attention variant of a user's own, registered from outside the package.

    python -m lit_growattn fit --config configs/mqar_grow.yaml --extensions=[toy_extension] \
        --model.init_args.attention=toy_mha --trainer.callbacks.init_args.growth.method=toy_sign
"""

from torch import Tensor

from lit_growattn.attention import register_attention
from lit_growattn.attention.mha import MultiHeadAttention
from lit_growattn.growth import Moments, register_direction


@register_direction("toy_sign")
def sign_descent(mo: Moments, rcond: float) -> Tensor:
    """ΔM = −sign(N̄): a descent direction (⟨N̄, ΔM⟩ = −‖N̄‖₁); `growth.direction` normalises its scale."""
    return -mo.n.sign()


@register_attention("toy_mha")
class ToyAttention(MultiHeadAttention):
    """Multi-head attention under a name of its own: growth needs nothing beyond the `Attention` protocol."""
