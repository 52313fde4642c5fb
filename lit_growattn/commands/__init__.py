"""The command line: `python -m lit_growattn fit|validate|test` (`cli.py`, LightningCLI), `convert` and `export`
(`convert.py`, `export.py`; they write through `lit_growattn.training.writing`, as the Python functions behind
them do), and the refusal of configs in an old spelling (`legacy.py`)."""
