#!/usr/bin/env python
"""Everything this project measures on a GPU, in one command, each step in a time box of its own (docs/gpu.md).

    bash scripts/gpu/check.sh                     # installs the wheels of .whl/ if there are any, then runs this
    python scripts/gpu/check.py --out DIR         # where the project's packages are installed (pip)
    python scripts/gpu/check.py --dry-run --out DIR   # CPU, tiny sizes: the same steps and JSON keys, no figures

Writes DIR/bench_gpu.json (the environment, each step's status, seconds and figures, and the checks) and
DIR/gpu_check.log (all that the steps printed); DIR defaults to $OUT. A step that fails or outruns its time box is
recorded as such, and the next step runs. The exit code is 1 when a step did not finish or a check failed.
A GPU's result is committed as scripts/results/bench_gpu.json, beside the CPU benchmarks' (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

RESULT, LOG = "bench_gpu.json", "gpu_check.log"
# Seconds per step on an H100, most valuable first: 9.8 minutes if every box ran full. `mfu` compiles GPT-2 small.
# `environment` also imports torch, lightning and the project once for all the steps that fork from it.
TIME_BOX_S = {"environment": 45, "gpu_tests": 120, "bench_gpu": 80, "sketch_1b": 90, "sketch_crossover": 60, "mfu": 90, "text_growth": 35, "fsdp2_growth": 30, "seed001": 40}
STEPS = [name for name in TIME_BOX_S if name != "environment"]
# A dry run's tiny steps take seconds, but on a CPU shared with the rest of a parallel test run they can take
# longer than the boxes sized for an H100: a box there catches a hang, not a slow machine.
DRY_RUN_SLACK = 4


def time_box(name: str, dry_run: bool) -> int:
    return TIME_BOX_S[name] * (DRY_RUN_SLACK if dry_run else 1)


def step_process(name: str, *args) -> None:
    """What a step's process runs: `steps`, which the fork server has imported already, does the work."""
    import steps

    steps.run_step(name, *args)


def run_step(context, name: str, dry_run: bool, work: Path, log: Path) -> dict:
    """`name` in a process of its own, ended with everything it started when its time box runs out. A step that
    does not finish is reported with what it kept in its folder's partial.json, if anything."""
    folder = work / name
    folder.mkdir()
    result_file, error_file, partial_file = folder / "result.json", folder / "error.txt", folder / "partial.json"
    process = context.Process(target=step_process, name=f"gpu_check {name}",
                              args=(name, dry_run, str(folder), str(result_file), str(error_file), str(log)))
    box = time_box(name, dry_run)
    started = time.perf_counter()
    process.start()
    process.join(box)
    timed_out = process.is_alive()
    try:  # the step's process group: what it started (inductor's compile workers, …) ends with it
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.join()
    if timed_out:
        status, error = "timed out", f"still running after its time box of {box} s"
    elif process.exitcode == 0:
        status, error = "ok", None
    else:
        status = "failed"
        error = error_file.read_text() if error_file.exists() else f"exit code {process.exitcode} (see the log)"
    kept = result_file if status == "ok" else partial_file
    return {"status": status, "seconds": round(time.perf_counter() - started, 1), "time_box_s": box,
            "error": error, "result": json.loads(kept.read_text()) if kept.exists() else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu/check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU at tiny sizes: checks the kit, no figures")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=STEPS,
                        help="run only these steps (default: all, in this order)")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("name a folder for the results: --out DIR (or set $OUT)")
    out = Path(args.out)
    taken = [str(out / name) for name in (RESULT, LOG) if (out / name).exists()]
    if taken:
        parser.error(f"{', '.join(taken)} exists already: give another --out folder")
    out.mkdir(parents=True, exist_ok=True)
    log = out / LOG

    def say(text: str) -> None:
        print(text, flush=True)
        with open(log, "a") as f:
            f.write(text + "\n")

    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's run, on a machine with a GPU too (steps inherit it)
    started = time.perf_counter()
    # The steps fork from a server that has imported their modules but never touches CUDA: each step starts in a
    # moment, and still initialises CUDA itself.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["steps"])
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        for name in ["environment", *args.steps]:
            say(f"== {name} (time box {time_box(name, args.dry_run)} s)")
            r = results[name] = run_step(context, name, args.dry_run, Path(work), log)
            why = f": {r['error'].strip().splitlines()[-1]}" if r["error"] else ""
            say(f"== {name}: {r['status']} in {r['seconds']} s{why}")
            if name == "environment":
                if r["result"] is None:
                    break  # torch, lightning or the project does not import: no step could run
                say(json.dumps(r["result"], indent=1))
                if not (args.dry_run or r["result"]["cuda_available"]):
                    parser.error("no CUDA GPU here: run it on one, or pass --dry-run to check the kit on CPU")
    environment = results.pop("environment")
    checks = {f"{name}: {check}": ok for name, r in results.items() if r["status"] == "ok"
              for check, ok in r["result"]["checks"].items()}
    document = {"dry_run": args.dry_run, "seconds": round(time.perf_counter() - started, 1),
                "environment": environment, "steps": results, "checks": checks}
    partial = out / f".{RESULT}.partial"
    partial.write_text(json.dumps(document, indent=1, default=str) + "\n")
    os.replace(partial, out / RESULT)
    say("checks: " + json.dumps(checks, indent=1))
    say(f"results: {out / RESULT}, log: {log} ({document['seconds']} s)")
    finished = environment["status"] == "ok" and all(r["status"] == "ok" for r in results.values())
    return 0 if finished and False not in checks.values() else 1


if __name__ == "__main__":
    raise SystemExit(main())
