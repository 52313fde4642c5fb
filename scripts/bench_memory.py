"""scripts/bench.py, measurements 4–5: memory of a statistics step, and the capture sweep of one layer."""

from __future__ import annotations

import time
from typing import Callable

import torch

from bench_setup import Env, Preset, Shape, auto_capture, fold, make_lm, median, named_forms, set_capture, token_data

from lit_growattn import growth  # bench_common has put the repository on the path
from lit_growattn.attention import QKForm


# -- 4. memory -------------------------------------------------------------------------------------
def cpu_allocation_peak(fn: Callable[[], None]) -> int:
    """Peak of the bytes allocated on the CPU while fn runs, above the level at its start, from the profiler's
    memory events (deterministic on one thread). The CPU counterpart of torch.cuda.max_memory_allocated: unlike
    the saved-tensor count it sees transients and the captured pairs, and that those come while the backward
    frees activations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak


def allocation_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Peak of the bytes allocated on `device` while fn runs, above the level at its start."""
    if device.type != "cuda":
        return cpu_allocation_peak(fn)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start


def measure_memory(shape: Shape, env: Env) -> dict:
    lm = make_lm(shape)
    forms = named_forms(lm)
    inputs, labels = (t for t in token_data(shape, 1).tensors)
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    stats = [growth.FormStats.empty_like(f, "natural") for _, _, f in forms]

    def step(mode: str | None, out: dict) -> None:
        """Forward, backward and fold of one statistics (or normal) step; fills out's byte counts."""
        saved: dict[int, int] = {}

        def pack(t):
            # Unique storages (views and repeated saves count once); parameters exist anyway and are left out.
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                saved[st.data_ptr()] = st.nbytes()
            return t

        set_capture(forms, mode)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm.loss(lm(inputs), labels)
        loss.backward()
        # The pairs wait in the forms until on_after_backward folds them: G X′ is new memory, X′ is an
        # activation that the forward saved anyway.
        out["captured_bytes"] = sum(gx.untyped_storage().nbytes() for _, _, f in forms for _, gx in f.captured)
        fold(forms, stats)
        set_capture(forms, None)
        out["saved_bytes"] = sum(saved.values())

    def one(mode: str | None) -> dict:
        out: dict = {}
        out["peak_bytes"] = cpu_allocation_peak(lambda: step(mode, out))
        lm.zero_grad(set_to_none=True)  # gradients are allocated inside every measured step, as in training
        return out

    one(None)  # first step: lazily created state is not part of the comparison
    got = {name: one(mode) for name, mode in (("normal", None), ("extend", "extend"), ("explicit", "explicit"))}
    base = got["normal"]
    # The headline follows docs/design.md §9: saved-for-backward bytes (deterministic on CPU).
    key = "saved_bytes"
    return {
        "bytes": got,
        "measure": "bytes saved for backward",
        "stats_peak_memory_ratio": got["extend"][key] / base[key],
        "explicit_peak_memory_ratio": got["explicit"][key] / base[key],
        # Allocation peak of the whole step (profiler memory events).
        "stats_alloc_peak_ratio": got["extend"]["peak_bytes"] / base["peak_bytes"],
        "explicit_alloc_peak_ratio": got["explicit"]["peak_bytes"] / base["peak_bytes"],
        # Saved tensors plus the captured pairs still held at the end of backward: an upper bound of the extra.
        "stats_memory_ratio_with_captured": (got["extend"]["saved_bytes"] + got["extend"]["captured_bytes"])
        / base["saved_bytes"],
        "explicit_memory_ratio_with_captured": (got["explicit"]["saved_bytes"] + got["explicit"]["captured_bytes"])
        / base["saved_bytes"],
    }


# -- 5. capture sweep (one attention layer) --------------------------------------------------------
def measure_capture_sweep(shape: Shape, p: Preset, env: Env) -> dict:
    """QKForm.attend forward+backward (+ fold) of one layer, tokens fixed, sequence length swept: the only part
    of a step that differs between the capture paths. Gives the rule for capture='auto'."""
    out = {}
    for s in p.sweep_seqs:
        b = max(1, p.sweep_tokens // s)
        torch.manual_seed(0)
        form = QKForm(shape.n_embd, shape.n_head, shape.d_head)
        x = torch.randn(b, s, shape.n_embd, requires_grad=True)
        v = torch.randn(b, shape.n_head, s, shape.n_embd // shape.n_head, requires_grad=True)
        w = torch.randn_like(v)
        st = growth.FormStats.empty_like(form, "natural")
        params = {q.untyped_storage().data_ptr() for q in form.parameters()}

        def run(mode):
            form.capture = mode
            saved = {}

            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = (form.attend(x, v) * w).sum()
            loss.backward()
            for xa, gx in form.take_captured():
                st.update(xa, gx)
            form.capture = None
            return time.perf_counter() - t0, sum(saved.values())

        modes = (None, "extend", "explicit")
        for m in modes:
            run(m)
        times = {str(m): [] for m in modes}
        mem = {}
        for r in range(p.repeats):
            for m in modes[r % 3:] + modes[: r % 3]:
                t, mem[str(m)] = run(m)
                times[str(m)].append(t)
        ratio = lambda a, c: median(x / y for x, y in zip(times[a], times[c]))  # noqa: E731
        out[f"s{s}_b{b}"] = {
            "normal_s": median(times["None"]),
            "extend_s": median(times["extend"]),
            "explicit_s": median(times["explicit"]),
            "extend_over_explicit": ratio("extend", "explicit"),
            "extend_saved_over_explicit_saved": mem["extend"] / mem["explicit"],
            "faster": "extend" if ratio("extend", "explicit") < 1 else "explicit",
            "smaller": "extend" if mem["extend"] < mem["explicit"] else "explicit",
            "auto_rule_picks": auto_capture(torch.zeros(b, s, dtype=torch.long)),
        }
        env.log(f"  sweep s{s}: {out[f's{s}_b{b}']}")
    return out
