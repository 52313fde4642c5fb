"""How a folder of a model type that lit_growattn registers (growattn_*, dint_*) is loaded: transformers itself does
not know the type, and its message for an unknown type advises upgrading transformers, which cannot help. The
folder gets a README.md saying to `import lit_growattn.hf` first.

No `auto_map` (trust_remote_code) loader is written: the only code it could run imports lit_growattn.hf, so it cannot
load the model without this package, and with one in config.json every `AutoConfig` or `AutoTokenizer` call on the
folder without the import asks interactively whether to run it."""

from __future__ import annotations

import json
import os
from pathlib import Path

MODEL_CARD = '''# {name}

A `{model_type}` model written by lit_growattn ({origin}). Its model type is registered by lit_growattn, not by
transformers itself, so import lit_growattn.hf (`pip install lit_growattn[hf]`) before loading it:

```python
import lit_growattn.hf  # registers {model_type}
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")  # loads without the import too
```

Without the import, transformers does not know the model type, and its message advises upgrading transformers,
which does not help; `trust_remote_code=True` does not help either (there is no code in this folder).
'''


def write_loading_files(folder: str | os.PathLike, model_type: str, name: str, origin: str) -> None:
    """For a model type that lit_growattn registers (growattn_*, dint_*): a README.md saying how to load the folder
    (transformers' own message for an unknown model type advises upgrading it)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.pop("auto_map", None) is not None:  # a model loaded from an earlier export names a loader not written
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(MODEL_CARD.format(name=name, model_type=model_type, origin=origin))
