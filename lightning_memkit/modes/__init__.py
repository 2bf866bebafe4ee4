"""Memory modes: precision and activation checkpointing as one value, and the comparison of modes.

Core code (no Lightning import except in comparison.py, which runs Trainers). Checkpointing is split by
concept: checkpoint_policy (policies, choice of regions), checkpoint_plan (records), checkpoint_wrap
(wrapping), checkpoint_measure (measuring); checkpointing applies them.

Import each name from the module that defines it."""
