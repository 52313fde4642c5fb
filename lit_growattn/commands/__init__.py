"""The command line: `python -m lit_growattn fit|validate|test` (`cli.py`, LightningCLI), `convert` and `export`
(`convert.py`), safe writing of the folders and files they produce (`writing.py`), and the refusal of configs in
an old spelling (`legacy.py`)."""
