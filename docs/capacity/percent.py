"""Per-cent helpers shared by the table scripts under docs/capacity."""


def above(loss: float, reference: float) -> float:
    """Per cent above `reference`."""
    return 100 * (loss / reference - 1)


def signed(percent: float) -> str:
    """With a true minus, as in the docs."""
    return f"{percent:+.2f}".replace("-", "−")
