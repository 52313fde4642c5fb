"""What the table scripts under docs/capacity share: per-cent helpers and the current rule's runs of seeds 3–5."""

import json
from pathlib import Path

HERE = Path(__file__).parent


def above(loss: float, reference: float) -> float:
    """Per cent above `reference`."""
    return 100 * (loss / reference - 1)


def signed(percent: float) -> str:
    """With a true minus, as in the docs."""
    return f"{percent:+.2f}".replace("-", "−")


def current_rule_runs() -> dict[str, dict]:
    """The 2-layer model's runs of seeds 3–5 under the current rule (static d_head 16 among them), per length:
    "750" steps (fresh_seeds) and "3000" (long_training), each corpus → seed → row → run."""
    return {"750": json.loads((HERE / "fresh_seeds" / "runs.json").read_text())["2layer"],
            "3000": json.loads((HERE / "long_training" / "runs.json").read_text())}
