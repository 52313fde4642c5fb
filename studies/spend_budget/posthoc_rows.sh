#!/usr/bin/env bash
# The activation-aware post-hoc rows of the spend_budget grid (README.md, "Commands"), each cell into its own file so
# that this never writes a file allocator_rows.sh writes. Resumable: kcache_study.py skips the runs its --out holds.
# Run from the repository root, on one core, after allocator_rows.sh: OMP_NUM_THREADS=1 bash studies/spend_budget/posthoc_rows.sh
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
CORPORA=${CORPORA:-/tmp/corpora}
K=studies/kcache_budget
S=studies/spend_budget
export OMP_NUM_THREADS=1
[ -f "$CORPORA/pystdlib.txt" ] && [ -f "$CORPORA/usrdoc.txt" ] || "$PY" studies/capacity/corpora.py "$CORPORA"
cell() {  # corpus model "budgets" "seeds"
  # shellcheck disable=SC2086  # budgets and seeds are lists of numbers
  "$PY" $K/kcache_study.py --text "$CORPORA/$1.txt" --corpus "$1" --model "$2" --seeds $4 --budgets $3 \
    --rows "activation-aware post-hoc" --from "$K/results_$2_$1.json" --out "$S/posthoc_$2_$1.json"
}
cell pystdlib 2layer "2 4" "0 1 2 3 4 5"
cell usrdoc 2layer 2 "0 1 2 3 4 5"
cell pystdlib 8layer 4 "0 1 2"
cell usrdoc 8layer 4 "0 1 2"
