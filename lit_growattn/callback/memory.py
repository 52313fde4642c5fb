"""How much memory the statistics of a growth window hold, and which layers an event grows when the statistics
of all layers at once would not fit (docs/hf.md, "Statistics memory": it grows as layers × heads × e′²; Llama-3.2-1B,
16 layers × 32 heads × 2048², needs about 8.6 GB of N in float32).

The window keeps per growing form C̄ (e′²) and N (h·e′²), plus C⁺NC⁺ (h·e′²) for method `pinv`, and per growing
value map C (h·e′²) and N (h·e′·e) (docs/value.md), in float32. Sketched (`statistics.sketch`, growth.sketch), a
form keeps C̄ and its range and co-range sketches, e′·(e′ + h·k + kv·l), and a value map kv·e′·k + h·e·l + h·e′·k_c
(`sums_numel`), and beside them the test matrices they were drawn with, as long (`tests_numel`): e′·(k + h·l) per
form, h·e·k + e′·(l + k_c) per value map, about a third more at Llama-3.2-1B's shape.
With `layers_per_event = k` each event grows k layers in turn (round-robin over the events) from its own window,
so a window holds the statistics of k layers only. The automatic schedule keeps the sums of half the window beside
the whole window's (`halves`), twice the memory of the sums (the half shares the whole's test matrices), and offers
every growing layer at each check.
"""

from __future__ import annotations

import math

from lit_growattn.contract import NamedForm
from lit_growattn.growth import SketchSize

BYTES = 4  # float32 sums

# How the memory line states each side's sums, from its first unit: query/key first, then values.
SUMS_TEXT = {
    "d_head": lambda form, method: (f"query/key {form.n_head} heads × e′² = {form.e_in}²"
                                    f"{', twice for pinv' if method == 'pinv' else ''}"),
    "d_v": lambda values, method: (f"values {values.n_head} heads × e′ × (e′ + e) = "
                                   f"{values.e_in} × {values.e_in + values.e_out}"),
}
SKETCH_TEXT = {
    "d_head": lambda form, size: (f"query/key e′ × (e′ + {form.n_head}k + {form.n_kv_head}l) = "
                                  f"{form.e_in} × {form.e_in + form.n_head * size.k + form.n_kv_head * size.l}, "
                                  f"test matrices e′ × (k + {form.n_head}l) = {form.e_in} × "
                                  f"{size.k + form.n_head * size.l}"),
    "d_v": lambda values, size: (f"values e′ × ({values.n_kv_head}k + {values.n_head}k_c) + e × {values.n_head}l = "
                                 f"{values.e_in} × {values.n_kv_head * size.k + values.n_head * size.k_c} + "
                                 f"{values.e_out} × {values.n_head * size.l}, test matrices e × {values.n_head}k + "
                                 f"e′ × (l + k_c) = {values.e_out} × {values.n_head * size.k} + {values.e_in} × "
                                 f"{size.l + size.k_c}"),
}


def form_bytes(form, method: str, sketch: SketchSize | None = None, halves: bool = False) -> int:
    """The statistics' bytes of one query/key form or value map: its full sums, or those of its sketch with the test
    matrices drawn beside them; with `halves` the sums twice (the half shares the whole's test matrices). Without a
    sketch the unit is asked only what `contract.Unit` documents (`sums_numel(method)`)."""
    if sketch is None:
        return BYTES * form.sums_numel(method) * (1 + halves)
    return BYTES * (form.sums_numel(method, sketch=sketch) * (1 + halves) + form.tests_numel(sketch))


def layers_of_event(layers: list[int], per_event: int | None, event: int) -> list[int]:
    """The layers event number `event` (0-based, skipped events included) grows: all, or the next `per_event`."""
    if per_event is None or per_event >= len(layers):
        return layers
    start = (event * per_event) % len(layers)
    return [layers[(start + i) % len(layers)] for i in range(per_event)]


def window_bytes(forms: list[NamedForm], layers: list[int], per_event: int | None, method: str, halves: bool = False,
                 sketch: SketchSize | None = None) -> tuple[int, dict[int, int]]:
    """The statistics' bytes of the largest window per rank, and those of each growing layer."""
    per_layer: dict[int, int] = {}
    for named in forms:
        if named.layer in layers:
            nbytes = form_bytes(named.form, method, sketch, halves)
            per_layer[named.layer] = per_layer.get(named.layer, 0) + nbytes
    worst = max(sum(per_layer[i] for i in layers_of_event(layers, per_event, n)) for n in range(len(layers)))
    return worst, per_layer


def size_text(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def _share(sketched: int, full: int) -> str:
    """e.g. `1/38 of`: the sketch's bytes against the full statistics'."""
    if sketched >= full:
        return "no less than"
    ratio = full / sketched
    return f"1/{ratio:.0f} of" if ratio >= 10 else f"1/{ratio:.2g} of"


def check_statistics_memory(forms: list[NamedForm], layers: list[int], per_event: int | None, method: str,
                            limit_gb: float | None, halves: bool = False, sketch: SketchSize | None = None,
                            offer: SketchSize | None = None) -> str:
    """The console line stating the window's statistics memory; a ValueError saying what to change when it exceeds
    `limit_gb` (None: no limit). `halves`: the window also keeps the sums of its first half (AutoSchedule);
    `sketch`: the statistics are sketched (growth.sketch); `offer`: the sketch statistics.sketch: on would keep,
    proposed when that fits (None: the sketch is in use, or cannot serve)."""
    worst, per_layer = window_bytes(forms, layers, per_event, method, halves, sketch)
    k = len(layers) if per_event is None else min(per_event, len(layers))
    first: dict[str, object] = {}
    for named in forms:
        first.setdefault(named.form.side, named.form)
    if sketch is None:
        parts = [text(first[side], method) for side, text in SUMS_TEXT.items() if side in first]
    else:
        full = window_bytes(forms, layers, per_event, method, halves)[0]
        parts = [text(first[side], sketch) for side, text in SKETCH_TEXT.items() if side in first]
        parts.append(f"sketch k = {sketch.k}, l = {sketch.l}, k_c = {sketch.k_c}: {_share(worst, full)} the full "
                     f"statistics' {size_text(full)}")
    if halves:
        parts.append("twice: the automatic schedule keeps each half of the window"
                     + (" (the sums; their test matrices once)" if sketch is not None else ""))
    line = (f"growth statistics: {size_text(worst)} per rank ({k} of {len(layers)} layers per window; "
            f"{'; '.join(parts)}; {BYTES} B each)")
    if limit_gb is not None and worst > limit_gb * 1e9:
        fix = _memory_fix(forms, per_layer, method, limit_gb * 1e9, halves)
        sketched = None if offer is None else window_bytes(forms, layers, per_event, method, halves, offer)[0]
        if sketched is not None and sketched <= limit_gb * 1e9:
            fix = (f"set statistics.sketch: on (with k = {offer.k} the window needs {size_text(sketched)} per rank; "
                   f"docs/design.md, sketched statistics), or without the sketch: {fix}")
        raise ValueError(f"{line} exceed statistics.max_memory_gb={limit_gb}: {fix}")
    return line


def _memory_fix(forms: list[NamedForm], per_layer: dict[int, int], method: str, limit: float, halves: bool) -> str:
    """What brings a window under `limit` bytes: fewer layers per window (with the automatic schedule, which offers
    every layer at each check: fewer growing layers), else a method without pinv's second sum, else a larger limit
    (only what would help, and nothing already in use)."""
    largest = max(per_layer.values())
    if (fits := math.floor(limit / largest)) >= 1:
        if halves:
            return (f"grow at most {fits} layer{'s' if fits > 1 else ''} with growth.layers (the automatic schedule offers every growing "
                    "layer at each check), or raise statistics.max_memory_gb")
        return f"set statistics.layers_per_event: {fits} (each event then grows {fits} layers in turn, each from its own window)"
    without_pinv = max(sum(form_bytes(f.form, "natural") * (1 + halves) for f in forms if f.layer == i) for i in per_layer)
    if method == "pinv" and without_pinv <= limit:
        return (f"one layer alone needs {largest / 1e9:.3g} GB with pinv's second sum: use method natural or gradient "
                f"({without_pinv / 1e9:.3g} GB per layer), or raise statistics.max_memory_gb")
    return f"one layer alone needs {largest / 1e9:.3g} GB: raise statistics.max_memory_gb above that"
