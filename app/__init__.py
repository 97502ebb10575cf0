"""Skrull on Ray: wiring, configuration and command-line entry points."""
