"""A small, quiet CPU Trainer for tests, writing under the directory it is given."""

from __future__ import annotations

import lightning.pytorch as pl


def make_trainer(tmp_path, **overrides) -> pl.Trainer:
    """A small, quiet CPU Trainer writing under ``tmp_path``."""
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "logger": False,
        "default_root_dir": str(tmp_path),
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "log_every_n_steps": 1,
    }
    options.update(overrides)
    return pl.Trainer(**options)
