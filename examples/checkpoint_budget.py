"""Activation checkpointing under a budget, chosen among the blocks you name, measured without the peak.

    python examples/checkpoint_budget.py             # CPU, about half a minute
    python examples/checkpoint_budget.py --steps 1   # the plan is made on the first batch: one step shows it

A budget is a fraction in (0, 1] of the baseline activation memory (``budget=0.5``) or a size with a unit
(``budget="16MiB"``); a bare number above 1 is refused. Naming a class with a budget
(``ActivationCheckpointing({nn.TransformerEncoderLayer}, budget=0.5)``) lets the budget choose only among
those modules. The first batch's measuring forwards keep no activation (their peak is a no_grad forward's).
"""

import argparse

from lightning.pytorch import Trainer
from torch import nn

from lightning_memkit import ActivationCheckpointing
from lightning_memkit.units import format_bytes
from lightning_memkit.zoo import DemoTransformer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=4, help="training steps (default: 4)")
steps = parser.parse_args().steps

model = DemoTransformer(d_model=64, layers=6, dim_feedforward=256, seq_len=64, batch_size=16)
checkpointing = ActivationCheckpointing({nn.TransformerEncoderLayer}, budget=0.5)
trainer = Trainer(
    max_steps=steps,
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    callbacks=[checkpointing],
)
trainer.fit(model)

plan = checkpointing.plan  # names and numbers: safe to keep after the fit
print(f"policy: {plan.policy}; checkpointed {plan.count} block(s): {', '.join(plan.names)}")
print(
    f"activation memory: {format_bytes(plan.baseline_activation_bytes)} -> "
    f"{format_bytes(plan.measured_activation_bytes)} (budget {format_bytes(plan.budget_bytes)}); the measuring "
    f"forwards peaked at {format_bytes(plan.measuring_peak_bytes)}"
)
