"""`python -m lit_growattn export --ckpt last.ckpt --out DIR`: a fine-tuned HFCausalLM checkpoint as a
`save_pretrained` folder (with the tokenizer of the folder it was fine-tuned from), which
`AutoModelForCausalLM.from_pretrained` loads after `import lit_growattn.hf` (the DINT classes are registered
there; no remote code).

Models fitted with `growable: false` (native or DINT attention) export as they are. Growable attention must
first be turned back into the model's own classes, which this command does not do: it refuses such a checkpoint.
"""

from __future__ import annotations

import argparse
import os

from lit_growattn.hf.growable import GrowableAttention
from lit_growattn.hf.module import HFCausalLM


def export_checkpoint(ckpt: str, out: str) -> None:
    module = HFCausalLM.load_from_checkpoint(ckpt, map_location="cpu")
    if any(isinstance(m, GrowableAttention) for m in module.model.modules()):
        raise ValueError(f"{ckpt} holds growable attention, which this export does not write back to the native "
                         "classes; fit with --model.init_args.growable=false to export")
    module.model.save_pretrained(out)
    source = module.hparams.get("pretrained")
    if source and any(os.path.isfile(os.path.join(source, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_growattn export", description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint written by fit with lit_growattn.hf.HFCausalLM")
    parser.add_argument("--out", required=True, help="folder to write the model (and tokenizer) to")
    args = parser.parse_args(argv)
    export_checkpoint(args.ckpt, args.out)
    print(f"wrote {args.out}; load it with `import lit_growattn.hf` and AutoModelForCausalLM.from_pretrained")
