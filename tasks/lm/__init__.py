"""The local code models: building them (tokenizer, training) and serving them (torch engine)."""
