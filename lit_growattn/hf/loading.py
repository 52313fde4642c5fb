"""How a folder of a model type that lit_growattn registers (growattn_*, dint_*) is loaded: transformers itself does
not know the type, and its message for an unknown type advises upgrading transformers, which cannot help. The
folder gets a README.md saying to `import lit_growattn.hf` first, and a loader module named in config.json's
`auto_map`, so that transformers asks for `trust_remote_code=True` instead, and then loads it."""

from __future__ import annotations

import json
import os
from pathlib import Path

LOADER = "lit_growattn_loader"
LOADER_CODE = '''"""Lets transformers load this folder without `import lit_growattn.hf` first, through
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`: this file only imports lit_growattn.hf (which
must be installed: pip install lit_growattn[hf]) and names the model classes it registers."""

import lit_growattn.hf  # noqa: F401  (registers the model types growattn_* and dint_* with the Auto classes)
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

Config = CONFIG_MAPPING[{model_type!r}]
ForCausalLM = AutoModelForCausalLM._model_mapping[Config]
'''
MODEL_CARD = '''# {name}

A `{model_type}` model written by lit_growattn ({origin}). Its model type is registered by lit_growattn, not by
transformers itself, so import lit_growattn.hf (`pip install lit_growattn[hf]`) before loading it:

```python
import lit_growattn.hf  # registers {model_type}
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{name}")
```

Without that import, `AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)` loads it too: the
only code it runs is `{loader}.py` here, which imports lit_growattn.hf. Without either, transformers refuses the folder.
'''


def write_loading_files(folder: str | os.PathLike, model_type: str, name: str, origin: str) -> None:
    """For a model type that lit_growattn registers (growattn_*, dint_*): a README.md saying how to load the folder,
    and a loader module named in config.json's `auto_map`. Without it, transformers without `import lit_growattn.hf`
    advises upgrading transformers; with it, transformers asks for trust_remote_code=True, which then loads."""
    folder = Path(folder)  # written in place of `name` (the folder's final path)
    (folder / f"{LOADER}.py").write_text(LOADER_CODE.format(model_type=model_type))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoConfig": f"{LOADER}.Config", "AutoModelForCausalLM": f"{LOADER}.ForCausalLM"}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (folder / "README.md").write_text(MODEL_CARD.format(name=name, model_type=model_type, origin=origin, loader=LOADER))
