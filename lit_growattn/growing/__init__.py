"""Old paths of the callback's modules, now in `lit_growattn.callback`: kept so that imports naming them still work."""
