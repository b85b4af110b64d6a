"""Built-in verifiers: run the target model on a draft tree and commit what it accepts."""
