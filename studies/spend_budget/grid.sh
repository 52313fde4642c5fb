#!/usr/bin/env bash
# The spend_budget grid (README.md, "Commands"), resumable: kcache_study.py skips the runs its --out already holds.
#   bash studies/spend_budget/grid.sh allocator   # grown and static-at-its-widths rows, the pre-registered cut last
#   bash studies/spend_budget/grid.sh posthoc     # activation-aware post-hoc rows, each cell in a file of its own
# Run from the repository root, one part at a time, on one core (it sets OMP_NUM_THREADS=1).
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
CORPORA=${CORPORA:-/tmp/corpora}
K=studies/kcache_budget
S=studies/spend_budget
export OMP_NUM_THREADS=1
[ -f "$CORPORA/pystdlib.txt" ] && [ -f "$CORPORA/usrdoc.txt" ] || "$PY" studies/capacity/corpora.py "$CORPORA"
cell() {  # file-prefix corpus model "budgets" "seeds" rows...
  local prefix=$1 corpus=$2 model=$3 budgets=$4 seeds=$5
  shift 5
  # shellcheck disable=SC2086  # budgets and seeds are lists of numbers
  "$PY" $K/kcache_study.py --text "$CORPORA/$corpus.txt" --corpus "$corpus" --model "$model" --seeds $seeds \
    --budgets $budgets --rows "$@" --from "$K/results_${model}_${corpus}.json" --out "$S/${prefix}_${model}_${corpus}.json"
}
case ${1:-} in
  allocator)
    rows=(grown "static at the allocator's widths")
    cell results pystdlib 2layer "2 4" "0 1 2 3 4 5" "${rows[@]}"
    cell results usrdoc 2layer 2 "0 1 2 3 4 5" "${rows[@]}"
    cell results pystdlib 8layer 4 "0 1 2" "${rows[@]}"
    cell results usrdoc 8layer 4 "0 1 2" grown
    cell results usrdoc 8layer 4 "0 1 2" "static at the allocator's widths" ;;  # the cut, if 4 CPU-hours would pass
  posthoc)
    for args in "pystdlib 2layer '2 4' '0 1 2 3 4 5'" "usrdoc 2layer 2 '0 1 2 3 4 5'" "pystdlib 8layer 4 '0 1 2'" \
                "usrdoc 8layer 4 '0 1 2'"; do
      eval "cell posthoc $args 'activation-aware post-hoc'"
    done ;;
  *) echo "usage: bash studies/spend_budget/grid.sh allocator|posthoc" >&2; exit 2 ;;
esac
