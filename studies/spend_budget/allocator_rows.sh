#!/usr/bin/env bash
# The allocator rows of the spend_budget grid (README.md, "Commands"), in the order that puts the pre-registered cut
# last. Each kcache_study.py invocation skips the runs its --out already holds, so this resumes where it stopped.
# Run from the repository root, on one core: OMP_NUM_THREADS=1 bash studies/spend_budget/allocator_rows.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
CORPORA=${CORPORA:-/tmp/corpora}
K=studies/kcache_budget
S=studies/spend_budget
export OMP_NUM_THREADS=1
[ -f "$CORPORA/pystdlib.txt" ] && [ -f "$CORPORA/usrdoc.txt" ] || "$PY" studies/capacity/corpora.py "$CORPORA"
rows=(grown "static at the allocator's widths")
cell() {  # corpus model "budgets" "seeds" rows...
  local corpus=$1 model=$2 budgets=$3 seeds=$4
  shift 4
  # shellcheck disable=SC2086  # budgets and seeds are lists of numbers
  "$PY" $K/kcache_study.py --text "$CORPORA/$corpus.txt" --corpus "$corpus" --model "$model" --seeds $seeds \
    --budgets $budgets --rows "$@" --from "$K/results_${model}_${corpus}.json" --out "$S/results_${model}_${corpus}.json"
}
cell pystdlib 2layer "2 4" "0 1 2 3 4 5" "${rows[@]}"
cell usrdoc 2layer 2 "0 1 2 3 4 5" "${rows[@]}"
cell pystdlib 8layer 4 "0 1 2" "${rows[@]}"
cell usrdoc 8layer 4 "0 1 2" grown
cell usrdoc 8layer 4 "0 1 2" "static at the allocator's widths"  # the cut, if 4 CPU-hours would be exceeded
