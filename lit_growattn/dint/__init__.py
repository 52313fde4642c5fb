"""DINT and low-rank DINT attention (differential attention with an integral map), as conversions of trained models:

gpt        the project's GPT: an mha checkpoint converted to the `dint` / `lowrank_dint` variants (the variants
           themselves are attention classes, `lit_growattn.attention.dint` and `.lowrank_dint`).
models     the conversion of a Hugging Face model or model folder (needs transformers); the DINT layer and the
           registered `dint_<family>` model classes it builds are `lit_growattn.hf.dint`'s (`attention` is its old path).
entropy    `AttentionEntropyCallback`: attention entropy during fine-tuning, beside the original model's.

A DINT model does not grow: these are fine-tuned as they are converted (docs/seed001.md).
Nothing is imported here, so that the GPT conversion does not need transformers.
"""
