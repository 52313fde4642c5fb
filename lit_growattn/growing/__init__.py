"""Old paths of the callback's modules, now in `lit_growattn.callback`: kept so that imports naming them still work."""

import importlib


def __getattr__(name: str):
    """`lit_growattn.growing.window` and the others without importing them by name, as before they moved."""
    if name in ("schedule", "event", "window", "memory", "report", "trainer_ops", "averaging"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
