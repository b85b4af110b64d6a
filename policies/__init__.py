"""Built-in tree policies. Each registers through ``goose_register_policies`` like any plugin."""
