"""Old path of `lit_growattn.callback.callback` (GrowAttentionCallback),
kept for the imports and configs that name it: this module is that one, the same object, so that a name patched
here is patched there."""

import sys

from lit_growattn.callback import callback as _new

sys.modules[__name__] = _new
