"""Prints the six-seed tables of docs/experiments_capacity.md, "What half the K cache costs a static model": static
d_head 8 in every layer at 750 steps against static d_head 16 of the same seed, beside the current rule's run from
d_head 1 and a static model trained at the widths it found, for both model sizes over seeds 0–5.

Static d_head 8: runs_six_seeds.json (2-layer seeds 0–2, 8-layer seeds 0–5) and runs.json (2-layer seeds 3–5).
Seeds 3–5 otherwise from ../fresh_seeds. Seeds 0–2: the current rule's runs from ../block_agreement (the runs its
block agreement changed) or else ../spare_width (gate_<size>.json); static 16 and the 2-layer static models at the
found widths from the earlier studies' folders named in `seeds_0_to_2`.

    python docs/capacity/half_k_cache/table_six_seeds.py
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tables import HERE, above, signed  # noqa: E402

CORPORA = ("usrdoc", "pystdlib", "shakespeare")


def load(path: str):
    return json.loads((HERE / path).read_text())


def by_seed(runs: list[dict]) -> dict[str, dict]:
    return {str(run["seed"]): run for run in runs}


def loss(run: dict | float) -> float:
    """A run's final validation loss; static16_seeds.json holds bare losses."""
    return run if isinstance(run, float) else run["final"]["loss"]


block_agreement = load("block_agreement/runs.json")
gates = {size: load(f"spare_width/gate_{size}.json") for size in ("2layer", "8layer")}


def seeds_0_to_2(size: str, corpus: str) -> dict[str, dict]:
    """seed → {"static d_head 16", "auto from d_head 1", "static at the auto sizes"} for seeds 0–2."""
    block, gate = block_agreement[size], gates[size]
    if size == "8layer":
        static16 = by_seed(load(f"deep_lr1e-3_{corpus}/experiments_capacity.json")["static d_head 16"])
        static_at_found = by_seed(gate["static"][corpus])
    else:
        static16 = load("static16_seeds.json")[corpus] | by_seed(
            load(f"{corpus}_static16/experiments_capacity.json")["static d_head 16"])
        static_at_found = by_seed(load(f"random_columns/{corpus}/experiments_capacity.json")
                                  ["static at the auto sizes"]) | by_seed(gate["static"][corpus])
    return {seed: {"static d_head 16": static16[seed],
                   "auto from d_head 1": block["auto"].get(corpus, {}).get(seed)
                   or by_seed(gate["auto"][corpus])[seed],
                   "static at the auto sizes": block["static"].get(corpus, {}).get(seed) or static_at_found[seed]}
            for seed in ("0", "1", "2")}


fresh = load("fresh_seeds/runs.json")
six_seeds, seeds_3_to_5 = load("half_k_cache/runs_six_seeds.json"), load("half_k_cache/runs.json")["750"]
static8 = {"2layer": {corpus: six_seeds["2layer"][corpus] | seeds_3_to_5[corpus] for corpus in CORPORA},
           "8layer": six_seeds["8layer"]}

for size in ("2layer", "8layer"):
    print(f"\n{size}, 750 steps\n")
    print("| corpus | seed | static 16 | static 8 (vs 16) | auto, current rule: found (vs 16), K cache | "
          "static at the found widths (vs 16) |")
    print("|---|---|---|---|---|---|")
    summaries = []
    for corpus in CORPORA:
        rows = seeds_0_to_2(size, corpus) | fresh[size][corpus]
        half, grown, at_found, both = [], [], [], 0
        for seed in sorted(static8[size][corpus]):
            reference = loss(rows[seed]["static d_head 16"])
            auto = rows[seed]["auto from d_head 1"]["final"]
            static_at_found = rows[seed]["static at the auto sizes"]["final"]
            if static_at_found["d_head"] != auto["d_head"]:
                raise SystemExit(f"{size} {corpus} seed {seed}: static at {static_at_found['d_head']}, "
                                 f"auto found {auto['d_head']}")
            eight = loss(static8[size][corpus][seed]["static d_head 8"])
            half.append(above(eight, reference))
            grown.append(above(auto["loss"], reference))
            at_found.append(above(static_at_found["loss"], reference))
            k_cache = 100 * sum(auto["d_head"]) / (16 * len(auto["d_head"]))
            both += grown[-1] <= 1 and k_cache <= 50
            print(f"| {corpus} | {seed} | {reference:.4f} | {eight:.4f} ({signed(half[-1])} %) | "
                  f"{auto['d_head']} ({signed(grown[-1])} %), {k_cache:.0f} % | {signed(at_found[-1])} % |")
        summaries.append(
            f"{corpus}: static 8 vs 16 on the mean {signed(statistics.mean(half))} %, within 1 % on "
            f"{sum(g <= 1 for g in half)} of {len(half)}; auto {signed(statistics.mean(grown))} %, within 1 % "
            f"with at most half the K cache on {both}; static at the found widths {signed(statistics.mean(at_found))} %")
    print("", *summaries, sep="\n")
