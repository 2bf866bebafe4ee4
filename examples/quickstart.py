"""The README's ten lines, runnable: every memkit callback on one Trainer, on CPU in about a minute.

    python examples/quickstart.py
"""

from lightning.pytorch import Trainer

from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryTracker
from lightning_memkit.zoo import DemoCNN

model = DemoCNN(blocks=3, batch_size=16)
trainer = Trainer(max_epochs=1, limit_train_batches=8, limit_val_batches=2, precision="bf16-mixed",
                  default_root_dir="memkit_logs/quickstart", enable_progress_bar=False, callbacks=[
    MemoryTracker(),                      # per-step memory in every logger, summary at fit end
    LayerTrace(at_steps=(1,)),            # step 1, module by module and by category
    ActivationCheckpointing("auto"),      # checkpoint ~sqrt(n) segments of the repeated blocks
    MaxBatchSize(max_val=256),            # largest batch that runs, found before fit
])
trainer.fit(model)
print(f"batch size chosen: {model.batch_size}")
