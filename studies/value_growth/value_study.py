"""Grow the value head size during training: does d_v grown from 4 to 16 end where a model built at 16 ends, and what
does a quarter of the V cache cost (studies/value_growth/README.md)? The rows, on the 2-layer text model of
configs/text_auto.yaml, query/key head size 16 in every row, every row trained for the same 750 steps:

    static d_v 16       the ceiling (the capacity study's static d_head 16 runs)
    static d_v 4        a quarter of its V cache
    grown d_v 4→16      from d_v 4, GrowAttentionCallback at epochs 1 and 2 (0-based), 6 value columns per head at
                        each, by the natural direction, from 16 statistics batches: d_v 4 → 10 → 16
    auto d_v 4, budget 16
                        from d_v 4, AutoSchedule(budget=16, check_every=50, spend_until=0.5) on the value side
                        (max_d_v 16, natural direction, 16 statistics batches). Its recorded runs are the earlier
                        rule's, which bought only what cleared the noise floor; AutoSchedule now spends the whole
                        budget at its last check, so a rerun of this row ends every layer at d_v 16

    python studies/value_growth/value_study.py --text FILE --corpus NAME --seeds 0 1 2 3 4 5

--rows picks a part of the grid; --override adds CLI overrides to every run. Results go to --out (default
studies/value_growth/results.json) after each run, as runs[corpus][row][seed]; a row × seed × corpus already there is
skipped, so the grid runs over several sessions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))  # study_runs, shared with the other studies
sys.path.insert(0, str(STUDIES / "kcache_budget"))

from study_runs import TEXT_SETTING, read_results, run, save, v_cache_bytes  # noqa: E402

from lit_growattn import AtEpochs, AutoSchedule, GrowAttentionCallback, GrowthSettings  # noqa: E402
from lit_growattn.callback.settings import StatisticsSettings  # noqa: E402

CONFIG = "configs/text_auto.yaml"  # its growth callback (query/key, automatic) is dropped in every row
D_HEAD = 16  # the query/key head size of every row: only the value side differs
SMALL, FULL = 4, 16
GROWN, AUTO = "grown d_v 4→16", "auto d_v 4, budget 16"
ROWS = {"static d_v 16": FULL, "static d_v 4": SMALL, GROWN: SMALL, AUTO: SMALL}  # each row's starting d_v
EPOCHS = [1, 2]  # as configs/text_grow.yaml
STATISTICS_BATCHES = 16  # as configs/text_grow.yaml
CHECK_EVERY = 50  # the automatic row's optimizer steps between checks, as configs/text_auto.yaml
OUT = Path(__file__).resolve().parent / "results.json"
WHAT = ("settings[corpus]: the overrides of its runs besides the corpus; runs[corpus][row][seed]: final "
        "validation loss and bpb, final d_head and d_v per layer, V-cache bytes per token (n_head × Σ d_v × 4), "
        "training FLOPs, wall seconds, step times (time: statistics_share is the statistics' share of training time, "
        "study_runs.StepTimer), the curve as [step, FLOPs, loss, d_v] and growths as [step, d_v before, d_v after]")


def value_growth(row: str) -> GrowAttentionCallback:
    """A growing row's callback, the query/key side left as it is: d_v 4 → 10 → 16 at listed epochs, or as the
    automatic schedule buys within a V cache of static d_v 16's."""
    statistics = StatisticsSettings(batches=STATISTICS_BATCHES)
    if row == AUTO:
        return GrowAttentionCallback(AutoSchedule(budget=FULL, check_every=CHECK_EVERY, spend_until=0.5),
                                     GrowthSettings(grow="value", method="natural", max_d_v=FULL), statistics)
    columns = (FULL - SMALL) // len(EPOCHS)
    return GrowAttentionCallback(AtEpochs(EPOCHS), GrowthSettings(grow="value", value_columns=columns,
                                                                  method="natural"), statistics)


def compact(result: dict) -> dict:
    """What results.json keeps of a run; the GPT has a value head per query head (n_head)."""
    final = result["final"]
    return {"loss": final["loss"], "bpb": final["bpb"], "d_head": final["d_head"], "d_v": final["d_v"],
            "step": final["step"], "vcache_bytes": v_cache_bytes(result["n_head"], final["d_v"]),
            "flops": result["flops"], "seconds": result["seconds"], "time": result["time"],
            "curve": [[p["step"], p["flops"], p["loss"], p["d_v"]] for p in result["curve"]],
            "growths": [[e["step"], e["d_v_before"], e["d_v"]] for e in result["events"]
                        if e["d_v"] != e["d_v_before"]]}


def run_grid(args, results: dict, work: Path) -> None:
    done = results["runs"].setdefault(args.corpus, {})
    common = [f"--data.init_args.path={args.text}", *settings(args)]
    for seed in args.seeds:
        for name in args.rows:
            if str(seed) in done.get(name, {}):
                continue
            overrides = [*common, f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
                         f"--model.init_args.d_head={D_HEAD}", f"--model.init_args.d_v={ROWS[name]}"]
            result = run(CONFIG, overrides, str(work), grow=False,
                         callbacks=[value_growth(name)] if name in (GROWN, AUTO) else [])
            done.setdefault(name, {})[str(seed)] = record = compact(result)
            save(results, args.out)
            print(json.dumps({"run": name, "seed": seed, **{k: record[k] for k in
                                                             ("loss", "d_v", "vcache_bytes", "flops", "seconds")},
                              "statistics_share": record["time"]["statistics_share"]}), flush=True)


def settings(args) -> list[str]:
    """Every run's overrides but the corpus's path (which differs from machine to machine)."""
    return [*TEXT_SETTING, *args.override]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="the corpus (a text file)")
    parser.add_argument("--corpus", required=True, help="its name in the results (shakespeare, pystdlib, usrdoc)")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help=f"rows to run (default all): {list(ROWS)}")
    parser.add_argument("--out", type=Path, default=OUT, help="the results JSON, read first and updated after each run")
    parser.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides for every run")
    args = parser.parse_args(argv)
    if unknown := [row for row in args.rows if row not in ROWS]:
        parser.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    if not Path(args.text).is_file():
        parser.error(f"--text {args.text} is not a file")
    results = read_results(parser, args.out, WHAT)
    recorded = results.setdefault("settings", {}).setdefault(args.corpus, settings(args))
    if recorded != settings(args):
        parser.error(f"{args.out} holds {args.corpus} runs with the overrides {recorded}, not {settings(args)}: give "
                     "the same --override, or another --out")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        run_grid(args, results, Path(work))


if __name__ == "__main__":
    main()
