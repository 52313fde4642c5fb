"""Old path of `lit_growattn.contract`, kept for users' code: the same module object under
both names, so an import or a monkeypatch through either reaches the one module."""

import sys

from lit_growattn import contract as _new

sys.modules[__name__] = _new
