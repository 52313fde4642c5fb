"""The statistics window of one growth event: which forms capture on each statistics step (round-robin),
folding the captured pairs into sums, the one all-reduce that closes it, and its checkpoint state.

Lightning-free: a `strategy` here is anything with `reduce(t, reduce_op="sum")` and `all_gather(t)` (the callback
passes `trainer_ops.WindowCollectives`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lit_growattn import growth
from lit_growattn.contract import CaptureMode, NamedForm
from lit_growattn.growth.sketch import SketchSums
from lit_growattn.callback.settings import Capture

NamedForms = list[NamedForm]

# Window settings (`check_resumed`) that versions before them did not save, with what such a version did: it kept
# the statistics in full.
SAVED_SINCE = {"statistics.sketch": "off", "statistics.sketch_size": None}


def capture_mode(capture: Capture, device: torch.device) -> CaptureMode:
    """The capture path of `capture='auto'` on `device`."""
    if capture != "auto":
        return capture
    # On CPU the explicit map is faster and smaller (docs/performance.md, scripts/bench.py's capture sweep),
    # because CPU SDPA builds the full map for the widened queries anyway. On GPU the explicit
    # map would lose flash attention, and the extension's memory grows with s·e′ instead of s².
    return "explicit" if device.type == "cpu" else "extend"


def layers_in_turn(layers: list[int], per_step: int, window_step: int) -> set[int]:
    """The layers captured at this step of the window: the next `per_step` of `layers`, in turn."""
    return {layers[(window_step * per_step + j) % len(layers)] for j in range(per_step)}


def _sums_dtype(forms: NamedForms) -> torch.dtype:
    """float64 sums when the model itself runs in float64 (precision="64-true"), else float32."""
    return torch.float64 if forms[0][2].leading_tensor.dtype == torch.float64 else torch.float32


def sketch_seed(event: str, unit: str) -> int:
    """The seed of the test matrices of `unit`'s sketch in the window of `event` (its name, e.g. `step 100`): a
    checksum of the names, the same on every rank and in a resumed process (Python's hash() of a str is salted per
    process), and another for every unit and event, so that no two sketches miss the same directions."""
    return zlib.crc32(f"{event}/{unit}".encode())


def unscaled(captured: tuple[Tensor, ...], gradient_parts: tuple[int, ...], grad_scale: float | None) -> tuple:
    """A captured tuple with the parts that carry the loss's gradient (`Sums.gradient_parts`) divided by a
    GradScaler's factor (None: none), the others as they are."""
    if grad_scale is None:
        return captured
    return tuple(t / grad_scale if i in gradient_parts else t for i, t in enumerate(captured))


def fold_captured(forms: NamedForms, stats: list[growth.Sums], weight: float, grad_scale: float | None,
                  half: list[growth.Sums] | None = None) -> None:
    """Folds each form's captured tuples (`update`'s arguments: (X′, G·X′), or a sketch's) into its sums. `weight`:
    the micro-batch's share of the optimizer step; `grad_scale`: a 16-mixed GradScaler's factor still in the
    gradients (None: none); `half`: sums that also take every other captured micro-batch of each form (those while
    they hold at most half the weight), so that the window splits into two halves (`half` and the rest) whatever the
    round-robin."""
    for i, (st, (_, _, form)) in enumerate(zip(stats, forms, strict=True)):
        targets = [st] + ([half[i]] if half is not None and 2 * half[i].weight <= st.weight else [])
        for captured in form.take_captured():
            parts = unscaled(captured, st.gradient_parts, grad_scale)
            try:
                for target in targets:
                    target.update(*parts, weight)
            except growth.NonFiniteStatistics:
                if grad_scale is None:
                    # Poison the sums rather than raise: after the all-reduce every rank sees the NaN and skips
                    # this growth together, and training goes on.
                    for target in targets:
                        target.weight.fill_(float("nan"))
                # With a GradScaler an overflow is routine (the scaler skips that optimizer step): drop the pair.


class StatsWindow:
    """Pending statistics of the next growth event, tagged with its name; `state_dict` survives checkpoints.
    With `halves`, `half` holds the sums of every other micro-batch of each form (`fold_captured`); with `sketch`,
    the sums are sketches of that size (growth.sketch), each unit's test matrices drawn from `sketch_seed` (the half
    the same as the whole, so that they subtract) and handed to the unit for the statistics steps."""

    event: str | None
    stats: list[growth.Sums] | None
    half: list[growth.Sums] | None
    kept: list[Any]  # batches kept for the step-size evaluations, as the dataloader yields them
    reduced: bool  # the sums are already summed over ranks (the window has closed)
    # The settings that decide what the sums and kept batches hold (statistics.batches,
    # accumulate_grad_batches, …), as the window began: a run resumed inside it must have the same.
    gathered_with: dict[str, Any] | None

    def __init__(self, method: str, halves: bool = False, sketch: growth.SketchSize | None = None):
        self.method, self.halves, self.sketch = method, halves, sketch
        self.clear()

    def clear(self) -> None:
        self.event, self.stats, self.half, self.kept, self.reduced, self.gathered_with = None, None, None, [], False, None

    def begin_step(self, event: str, forms: NamedForms, active: set[int], mode: CaptureMode, gathered_with: dict,
                   keep=None) -> None:
        """Turns capture on for the forms of the `active` layers; `gathered_with`: the settings the window is
        gathered with (see `check_resumed`); `keep`: a batch to keep (a clone of its tensors)."""
        if self.event != event:
            self.clear()  # statistics of another event (an older checkpoint's) never leak into this one
            self.event, self.gathered_with = event, gathered_with
        if self.stats is None:
            self.stats = self._empty_sums(forms)
            if self.halves:
                self.half = self._empty_half(forms)
        for layer, _, form in forms:
            form.capture = mode if layer in active else None
        if self.sketch is not None:
            self.to(forms[0][2].leading_tensor.device)  # the test matrices too: sums restored on the CPU
            for (layer, _, form), st in zip(forms, self.stats, strict=True):
                form.sketch = st.tests if layer in active else None
        if keep is not None:
            self.kept.append(apply_to_collection(keep, Tensor, lambda t: t.detach().clone()))

    def _empty_sums(self, forms: NamedForms) -> list[growth.Sums]:
        dtype = _sums_dtype(forms)
        if self.sketch is None:  # only what contract.Unit documents: a unit of one's own need know no sketch
            return [form.empty_sums(self.method, dtype) for _, _, form in forms]
        return [form.empty_sums(self.method, dtype, sketch=self.sketch, seed=sketch_seed(self.event, name))
                for _, name, form in forms]

    def _empty_half(self, forms: NamedForms) -> list[growth.Sums]:
        """The half's sums: under the sketch with the whole's test matrices (drawn once, held once)."""
        if self.sketch is None:
            return self._empty_sums(forms)
        dtype = _sums_dtype(forms)
        return [form.empty_sums(self.method, dtype, sketch=self.sketch, seed=st.tests.seed, tests=st.tests)
                for (_, _, form), st in zip(forms, self.stats, strict=True)]

    def _share_tests(self) -> None:
        """The half's sketches take the whole's test matrices (a restored window drew them for each)."""
        for whole, half in zip(self.stats or [], self.half or []):
            if isinstance(whole, SketchSums) and isinstance(half, SketchSums):
                half.tests = whole.tests

    def end_step(self, forms: NamedForms) -> None:
        for _, _, form in forms:
            form.capture = None
            if self.sketch is not None:
                form.sketch = None
            form.take_captured()  # drops anything a skipped backward left behind

    def to(self, device: torch.device) -> None:
        """Moves the sums to `device`: a checkpoint restores them on the CPU, whatever device the model is on."""
        for st in self.stats or []:
            st.to(device)
        self._share_tests()  # then moving the half moves no test matrices
        for st in self.half or []:
            st.to(device)
        self._share_tests()

    def _sums(self) -> list[growth.Sums]:
        """The whole window's sums, then those of the half (one list, reduced and saved together)."""
        return (self.stats or []) + (self.half or [])

    def _split(self, sums: list[growth.Sums]) -> None:
        cut = len(sums) // 2 if self.halves else len(sums)
        self.stats, self.half = sums[:cut], (sums[cut:] if self.halves else None)
        self._share_tests()

    def close(self, strategy, world: int, device: torch.device) -> None:
        """Sums the statistics over ranks (the one collective of the window) and gathers the kept batches, as
        soon as the window ends: every rank then holds the same state, which a checkpoint saves whole."""
        self.to(device)
        sums = self._sums()
        self._split(growth.unflatten_stats(strategy.reduce(growth.flatten_stats(sums), reduce_op="sum"), sums))
        self.kept = _gather_batches(strategy, self.kept, world)
        self.reduced = True

    def state_dict(self, strategy, world: int) -> dict:
        stats, kept = (self._sums() or None), self.kept
        per_rank = stats is not None and not self.reduced and world > 1
        if per_rank:
            # Inside the window every rank holds its own partial sums: keep all of them (this runs on every
            # rank, and only rank 0's copy is written), so that each rank resumes with its own.
            stats = strategy.all_gather(growth.flatten_stats(stats))
            kept = _gather_batches(strategy, kept, world)
        return {
            "event": self.event,
            "reduced": self.reduced,
            "per_rank": per_rank,
            "world_size": world,
            "halves": self.halves,
            "stats": None if stats is None else {
                "flat": (stats if per_rank else growth.flatten_stats(stats)).cpu(),
                "like": [s.state_dict() for s in self._sums()],
            },
            "kept": [apply_to_collection(b, Tensor, Tensor.cpu) for b in kept],
            "gathered_with": self.gathered_with,
        }

    def load_state_dict(self, state: dict, rank: int, world: int) -> None:
        if state["per_rank"] and state["world_size"] != world:
            raise RuntimeError(
                f"this checkpoint was taken inside the statistics window of growth {state['event']!r} by "
                f"{state['world_size']} ranks, each holding its own partial sums, and cannot be split over {world}: "
                f"resume it with {state['world_size']} ranks (devices × num_nodes), or from a checkpoint taken "
                "outside the window"
            )
        self.clear()
        if state.get("halves", False) != self.halves:
            # Written by a run with the other schedule kind: its sums cannot serve this one; the event is skipped.
            return
        self.event, self.reduced = state["event"], state["reduced"]
        stats, kept = state["stats"], list(state["kept"])
        if state["per_rank"]:
            stats = {**stats, "flat": stats["flat"][rank]}
            kept = kept[rank::world]
        if stats is not None:
            like = [growth.stats_from_state_dict(s) for s in stats["like"]]
            self._split(growth.unflatten_stats(stats["flat"], like))
        self.kept = kept
        self.gathered_with = state.get("gathered_with")  # absent from checkpoints of earlier versions

    def check_resumed(self, settings: dict[str, Any]) -> None:
        """Refuses to go on with an open window (resumed from a checkpoint taken inside it) under other `settings`
        than it began with: its sums would mix two windows, and the step size differ from the uninterrupted run's."""
        if self.stats is None or self.reduced or self.gathered_with is None:
            return
        # A setting the checkpoint's version did not save yet had, in that version, the value it stands for.
        began = {**{k: v for k, v in SAVED_SINCE.items() if k in settings}, **self.gathered_with}
        if changed := {k: (v, settings.get(k)) for k, v in began.items() if settings.get(k) != v}:
            listed = ", ".join(f"{k}={old} in the checkpoint but {new} now" for k, (old, new) in changed.items())
            again = " and ".join(f"{k}={old}" for k, (old, _) in changed.items())
            raise ValueError(
                f"this checkpoint was taken inside the statistics window of growth {self.event!r}, which began with "
                f"other settings: {listed}. Going on would mix two windows' statistics and choose another step size "
                f"than the uninterrupted run: resume with {again}, or from a checkpoint taken outside the window "
                "(before it began, or after the growth)"
            )


def _gather_batches(strategy, batches: list[Any], world: int) -> list[Any]:
    """The kept batches of all ranks, batch-major (batch k of rank r at index k·world + r); every tensor of a
    batch has the same shape on every rank."""
    if world == 1:
        return batches
    gathered = [apply_to_collection(batch, Tensor, strategy.all_gather) for batch in batches]
    return [apply_to_collection(batch, Tensor, lambda t: t[r]) for batch in gathered for r in range(world)]
