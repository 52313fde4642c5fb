"""Spend a K-cache budget where it pays: `AutoSchedule(budget=b)` against the baselines of the field at equal K cache
(studies/kcache_budget/README.md). The rows, at each budget b (a mean query/key head size over the layers):

    uniform static b                    d_head b in every layer (Thin Keys' choice)
    grown b                             AutoSchedule with budget b, from d_head 1 (configs/text_auto.yaml)
    static at the allocator's widths b  from scratch at the widths grown b ended at (same seed): path or allocation?
    post-hoc b                          static 16 for 2/3 of the steps, shrunk per layer to the budget by SVD energy
                                        (convert --kv_budget b, the sizes of growth.shrink.allocate_ranks;
                                        Palu/Eigen-style), fine-tuned for the rest
    activation-aware post-hoc b         the same, shrunk by the activations instead (convert --kv_budget b
                                        --calibration on 1024 windows of the corpus's training split: sizes and
                                        factors from the SVD of C̄^½ M C̄^½)

and once per seed "static 16" (the ceiling). The results also hold "grown, no budget" (budget null: every column that
cleared the noise floor), which `summary.py` still renders; it no longer runs, since AutoSchedule refuses budget null
(issue 54). Every row trains the same number of steps (the auto config's 750-step setting). The grown rows of this
folder's results ran the earlier rule, which bought only columns above the noise floor; AutoSchedule now spends the
whole budget at its last check, so new grown rows go to another --out (studies/spend_budget), never into a file that holds the earlier rule's.

    python studies/kcache_budget/kcache_study.py --text FILE --corpus NAME --model 2layer --seeds 0 1 2 3 4 5

--budgets (default 2 4) and --rows (row kinds, default all) pick a part of the grid; --override adds CLI overrides to
every run. Results go to --out (default studies/kcache_budget/results.json) after each run, as
runs[model][corpus][row][seed]; a row × seed × corpus already there is skipped, so the grid runs over several
sessions. The post-hoc rows of one seed share their static-16 phase within an invocation. --from names other results
files read as inputs only (a row that needs another row's result, such as post-hoc's "uniform static b", finds it
there): nothing of them is copied into --out, so a merge of the files holds no run twice.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))  # study_runs, shared with the other studies

from study_runs import (TEXT_SETTING, fine_tune_shrunk, k_cache_bytes, read_results, run, save,  # noqa: E402
                        shrink_query_keys, sizes, train_to_shrink)


CONFIG = "configs/text_auto.yaml"  # static rows drop its growth callback and set d_head (as the capacity study)
FULL = 16  # the ceiling's head size, and the width the post-hoc rows start from
MODELS = {"2layer": [], "8layer": ["--model.init_args.n_layer=8", "--model.init_args.optimizer.init_args.lr=0.001"]}
KINDS = ["static 16", "uniform static", "grown", "static at the allocator's widths", "post-hoc",
         "activation-aware post-hoc"]
PER_BUDGET = KINDS[1:]
NEEDS = {"static at the allocator's widths": "grown", "post-hoc": "uniform static",
         "activation-aware post-hoc": "uniform static"}  # the row whose result it takes
CALIBRATION_SEQUENCES = 1024  # × 64 bytes: the 65,536 tokens of one statistics window of a grown run
VAL_FRACTION = 0.1  # the data module's default: the calibration text is the rest, the training split
BUDGET = "--trainer.callbacks.init_args.schedule.init_args.budget"
OUT = Path(__file__).resolve().parent / "results.json"
WHAT = ("settings[model][corpus]: the overrides of its runs besides the corpus; runs[model][corpus][row][seed]: final "
        "validation loss and bpb, final d_head per layer, K-cache bytes per token, training FLOPs, wall seconds, step "
        "times (time: statistics_share is the statistics' share of training time, study_runs.StepTimer), the curve as "
        "[step, FLOPs, loss], growths as [step, d_head] and the last check's scalars")


def row_names(kinds: list[str], budgets: list[int]) -> list[str]:
    """The rows of one seed, in the order they run: each budget's rows after the ceiling."""
    names = ["static 16"] if "static 16" in kinds else []
    return names + [f"{kind} {b}" for b in budgets for kind in PER_BUDGET if kind in kinds]


def compact(result: dict) -> dict:
    """What results.json keeps of a run; the GPT has a key head per query head (n_head)."""
    final = result["final"]
    return {"loss": final["loss"], "bpb": final["bpb"], "d_head": final["d_head"], "step": final["step"],
            "kcache_bytes": k_cache_bytes(result["n_head"], final["d_head"]), "flops": result["flops"],
            "seconds": result["seconds"], "time": result["time"],
            "curve": [[p["step"], p["flops"], p["loss"]] for p in result["curve"]],
            "growths": [[e["step"], e["d_head"]] for e in result["events"] if e["d_head"] != e["d_head_before"]],
            # The last check's scalars (its decision inputs left out): what it says of the budget, such as unspent.
            "last_check": {k: v for k, v in result["events"][-1].items() if isinstance(v, (int, float, str, bool))}
            if result["events"] else None}


def missing_inputs(names: list[str], stored: list[dict], seed: int) -> list[str]:
    """Rows that need another row's result of the same seed that is neither stored (in --out or a --from file) nor
    run in this invocation."""
    out = []
    for name in names:
        kind, _, b = name.rpartition(" ")
        need = f"{NEEDS[kind]} {b}" if kind in NEEDS else None
        if need and need not in names and not any(str(seed) in cell.get(need, {}) for cell in stored):
            out.append(f"{name!r} needs {need!r}")
    return out


def training_split(text: str, work: Path) -> Path:
    """The corpus's training split (its bytes before the held-out last VAL_FRACTION), as a file in `work`."""
    data = Path(text).read_bytes()
    split = work / "training_split.txt"
    if not split.exists():
        split.write_bytes(data[:len(data) - int(len(data) * VAL_FRACTION)])
    return split


def stored_run(cells: list[dict], row: str, seed: int) -> dict:
    """A row's run of `seed`, from --out (run in this invocation or an earlier one) or a --from file."""
    return next(cell[row][str(seed)] for cell in cells if str(seed) in cell.get(row, {}))


def run_grid(args, results: dict, inputs: list[dict], work: Path) -> None:
    done = results["runs"].setdefault(args.model, {}).setdefault(args.corpus, {})
    names, logs = row_names(args.rows, args.budgets), str(work)
    common = [f"--data.init_args.path={args.text}", *settings(args)]
    for seed in args.seeds:
        seeded = [*common, f"--seed_everything={seed}", f"--data.init_args.seed={seed}"]
        trained, first = work / f"static16_seed{seed}.ckpt", None
        for name in names:
            if str(seed) in done.get(name, {}):
                continue
            kind, _, b = name.rpartition(" ")
            stored = lambda row: stored_run([done, *inputs], row, seed)  # noqa: E731
            if name == "static 16":
                result = run(CONFIG, [*seeded, f"--model.init_args.d_head={FULL}"], logs, grow=False)
            elif kind == "uniform static":
                result = run(CONFIG, [*seeded, f"--model.init_args.d_head={b}"], logs, grow=False)
            elif kind == "grown":
                result = run(CONFIG, [*seeded, f"{BUDGET}={b}"], logs, grow=True)
            elif kind == "static at the allocator's widths":
                result = run(CONFIG, [*seeded, sizes(stored(f"grown {b}")["d_head"])], logs, grow=False)
            else:  # the post-hoc rows, as long in all as the uniform static row of their budget
                steps = stored(f"uniform static {b}")["step"]
                first = first or train_to_shrink(CONFIG, seeded, steps, trained, logs)
                shrink = (shrink_query_keys(int(b)) if kind == "post-hoc" else
                          shrink_query_keys(int(b), training_split(args.text, work), CALIBRATION_SEQUENCES))
                result = fine_tune_shrunk(CONFIG, seeded, first, trained, shrink, steps, work, logs)
            done.setdefault(name, {})[str(seed)] = compact(result)
            save(results, args.out)
            record = done[name][str(seed)]
            print(json.dumps({"run": name, "seed": seed, **{k: record[k] for k in
                                                             ("loss", "d_head", "kcache_bytes", "flops", "seconds")},
                              "statistics_share": record["time"].get("statistics_share")}), flush=True)


def settings(args) -> list[str]:
    """Every run's overrides but the corpus's path (which differs from machine to machine)."""
    return [*TEXT_SETTING, *MODELS[args.model], *args.override]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="the corpus (a text file)")
    parser.add_argument("--corpus", required=True, help="its name in the results (shakespeare, pystdlib, usrdoc)")
    parser.add_argument("--model", choices=list(MODELS), required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2, 4], help="mean head sizes (default 2 4)")
    parser.add_argument("--rows", nargs="+", default=KINDS, help=f"row kinds to run (default all): {KINDS}")
    parser.add_argument("--out", type=Path, default=OUT, help="the results JSON, read first and updated after each run")
    parser.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides for every run")
    parser.add_argument("--from", dest="inputs", type=Path, nargs="+", default=[],
                        help="results files whose runs are read as inputs, never copied into --out")
    args = parser.parse_args(argv)
    if unknown := [kind for kind in args.rows if kind not in KINDS]:
        parser.error(f"unknown row kinds {unknown}; known: {KINDS}")
    if bad := [b for b in args.budgets if not 1 <= b < FULL]:
        parser.error(f"budgets {bad} are not mean head sizes between 1 and {FULL - 1}")
    if not Path(args.text).is_file():
        parser.error(f"--text {args.text} is not a file")
    results = read_results(parser, args.out, WHAT)
    recorded = results.setdefault("settings", {}).setdefault(args.model, {}).setdefault(args.corpus, settings(args))
    if recorded != settings(args):
        parser.error(f"{args.out} holds {args.model} {args.corpus} runs with the overrides {recorded}, not "
                     f"{settings(args)}: give the same --override, or another --out")
    inputs = [input_cell(parser, path, args) for path in args.inputs]
    done = results["runs"].get(args.model, {}).get(args.corpus, {})
    if "grown" in args.rows and any("fill_to" not in (run["last_check"] or {}) for b in args.budgets
                                    for run in done.get(f"grown {b}", {}).values()):
        parser.error(f"{args.out} holds grown rows of the earlier rule (the floor alone, which left budget unspent): "
                     "write the rule that spends the whole budget to another --out, reading this file with --from")
    names = row_names(args.rows, args.budgets)
    if problems := [p for seed in args.seeds for p in missing_inputs(names, [done, *inputs], seed)]:
        parser.error(f"{'; '.join(sorted(set(problems)))}: add its row kind to --rows, or give a results file "
                     "that holds it with --from")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        run_grid(args, results, inputs, Path(work))


def input_cell(parser: argparse.ArgumentParser, path: Path, args) -> dict:
    """The runs of this model and corpus in a --from file, refused unless they ran with the same overrides."""
    if path.resolve() == args.out.resolve():
        parser.error(f"--from {path} is the --out file: it is read anyway")
    if not path.is_file():
        parser.error(f"--from {path} is not a file")
    results = read_results(parser, path, WHAT)
    recorded = results.get("settings", {}).get(args.model, {}).get(args.corpus)
    if recorded != settings(args):
        parser.error(f"--from {path} holds {args.model} {args.corpus} runs with the overrides {recorded}, not "
                     f"{settings(args)}: its runs are not comparable")
    return results["runs"][args.model][args.corpus]


if __name__ == "__main__":
    main()
