"""Built-in draft sources. Each registers through ``goose_register_sources`` like any plugin."""
