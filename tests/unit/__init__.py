"""Fast tests that need no server: limits, keys, config files, the models' invariants."""
