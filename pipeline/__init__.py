"""Wiring: the launch CLI, the config schema, runtimes, metrics and the replay CLI. No algorithm math."""
