"""Thin Lightning adapters over memkit's core: each wires measuring code to Trainer hooks.

Import each name from the module that defines it."""
