"""One Hugging Face tiny Llama growing both sides of its attention (studies/value_growth/README.md, "Hugging Face").

The model and data of configs/hf_llama_grow.yaml (Llama architecture, 2 layers, hidden 64, RoPE, GQA: 4 query heads
share 2 key/value heads, head_dim 8; bytes of the given text, 4 epochs of 250 steps), seed 0, one run per row,
reported beside each other and not judged (one seed):

    static head_dim 8       the model as configured (K and V cache of head_dim 8)
    static head_dim 16      built at twice the head size (the ceiling; every query/key column rotary, where the
                            grown model's 8 new ones are position-independent)
    static d_head 8, d_v 16 head_dim 16 with rotary_dim 8: query/key head size 8 (RoPE of head_dim 8), value head
                            size 16: the value side alone at the ceiling's width
    grown both 8→16         from head_dim 8, the config's AtEpochs([1, 2]) growing both sides (growth.grow: both),
                            4 query/key and 4 value columns at each event: d_head and d_v 8 → 12 → 16

The grown model is exported (`python -m lit_growattn export`) and loaded back with `from_pretrained`, as a user
loads a downloaded folder; its logits and greedy generation are compared with the trained module's.

    python studies/value_growth/hf_llama_both.py --text tinyshakespeare.txt     # writes hf_llama_both.json beside it
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

STUDIES = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(STUDIES))  # study_runs, shared with the other studies

from study_runs import k_cache_bytes, run, v_cache_bytes  # noqa: E402

from lit_growattn.commands.export import main as export  # noqa: E402
from lit_growattn.hf import HFCausalLM  # noqa: E402

CONFIG = "configs/hf_llama_grow.yaml"
KV_HEADS = 2
GROWN = "grown both 8→16"
ROWS = {
    "static head_dim 8": [],
    "static head_dim 16": ["--model.init_args.config.head_dim=16"],
    "static d_head 8, d_v 16": ["--model.init_args.config.head_dim=16", "--model.init_args.rotary_dim=8"],
    GROWN: ["--trainer.callbacks.init_args.growth.grow=both", "--trainer.callbacks.init_args.growth.columns=4",
            "--trainer.callbacks.init_args.growth.value_columns=4"],
}
OUT = Path(__file__).resolve().parent / "hf_llama_both.json"


def exported_matches(checkpoint: Path, folder: Path) -> dict:
    """Exports the checkpoint and loads it with from_pretrained: the largest logit difference on random ids against
    the trained module, and whether 20 greedy tokens agree."""
    from transformers import AutoModelForCausalLM

    export(["--ckpt", str(checkpoint), "--out", str(folder)])
    trained = HFCausalLM.load_from_checkpoint(checkpoint, map_location="cpu").model.eval()
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, trained.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    greedy = lambda m: m.generate(ids[:1, :4], max_new_tokens=20, do_sample=False, pad_token_id=0)  # noqa: E731
    with torch.no_grad():
        difference = float((trained(ids).logits - loaded(ids).logits).abs().max())
        same = bool(torch.equal(greedy(trained), greedy(loaded)))
    return {"architecture": loaded.config.architectures, "qk_head_sizes": loaded.config.qk_head_sizes,
            "v_head_sizes": loaded.config.v_head_sizes, "max_logit_difference": difference,
            "same_greedy_generation": same}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, help="the corpus (a text file)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--override", nargs="+", action="extend", default=[], help="extra CLI overrides for every run")
    args = parser.parse_args(argv)
    if not Path(args.text).is_file():
        parser.error(f"--text {args.text} is not a file")
    results = {"what": "seed 0, one run per row of " + CONFIG + "; final validation loss, head sizes, K and V cache "
                       "bytes per token (float32), wall seconds; the grown row's export loaded with from_pretrained",
               "runs": {}}
    with tempfile.TemporaryDirectory() as work:
        for name, overrides in ROWS.items():
            checkpoint = Path(work) / f"{len(results['runs'])}.ckpt"
            result = run(CONFIG, [f"--data.init_args.path={args.text}", *overrides, *args.override], work,
                         grow=name == GROWN, save=checkpoint)
            final = result["final"]
            record = {"loss": final["loss"], "d_head": final["d_head"], "d_v": final["d_v"],
                      "kcache_bytes": k_cache_bytes(KV_HEADS, final["d_head"]),
                      "vcache_bytes": v_cache_bytes(KV_HEADS, final["d_v"]), "seconds": result["seconds"],
                      "growths": [[e["step"], e["d_head"], e["d_v"]] for e in result["events"]]}
            if name == GROWN:
                record["export"] = exported_matches(checkpoint, Path(work) / "exported")
            results["runs"][name] = record
            print(json.dumps({"run": name, **record}), flush=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
