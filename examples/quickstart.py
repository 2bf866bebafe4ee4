"""The README's ten lines, runnable: every memkit callback on one Trainer, on CPU in about a minute.

python examples/quickstart.py
python examples/quickstart.py --max-batch-size 32   # a smaller search: seconds instead of a minute
"""

import argparse

from lightning.pytorch import Trainer

from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryTracker
from lightning_memkit.zoo import DemoCNN

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--max-batch-size", type=int, default=256, help="the largest batch MaxBatchSize tries (default: 256)"
)
max_batch_size = parser.parse_args().max_batch_size

model = DemoCNN(blocks=3, batch_size=16)
trainer = Trainer(
    max_epochs=1,
    limit_train_batches=8,
    limit_val_batches=2,
    precision="bf16-mixed",
    default_root_dir="memkit_logs/quickstart",
    enable_progress_bar=False,
    callbacks=[
        MemoryTracker(),  # per-step memory in every logger, summary at fit end
        LayerTrace(at_steps=(1,)),  # step 1, module by module and by category
        ActivationCheckpointing("auto"),  # checkpoint ~sqrt(n) segments of the repeated blocks
        MaxBatchSize(max_val=max_batch_size),  # largest batch that runs, found before fit
    ],
)
trainer.fit(model)
print(f"batch size chosen: {model.batch_size}")
