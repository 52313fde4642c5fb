"""The Lightning glue shared by `GrowAttentionLM` and `HFCausalLM`: their common base (`lm.py`), the optimizer and
its schedule (`optimization.py`), Adam's state carried across a growth (`optim_state.py`), checkpoint reading
(`checkpoint.py`), the safe writing of what `convert` and `export` make (`writing.py`), the divergence guard
(`divergence.py`), and the few Lightning internals the project reads (`lightning_private.py`, each with the test
that notices when Lightning changes it)."""
