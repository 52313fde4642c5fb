"""The model: the project's GPT (`gpt.py`), built from the variants of `lit_growattn.attention`, and its settings
(`config.py`). The protocols a growable model keeps are `lit_growattn.contract`'s."""
