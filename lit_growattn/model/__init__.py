"""The model: the project's GPT (`gpt.py`), its settings (`config.py`), and the contract every growable attention
keeps (`contract.py`: the query/key form a growth reads and writes). The attention variants live in
`lit_growattn.attention`. Nothing is imported here, so that the attention variants can import the config and the
contract without importing the GPT that is built from them."""
