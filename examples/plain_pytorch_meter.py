"""MemoryMeter around a plain PyTorch training loop (no Lightning): exact per-step tensor bytes.

python examples/plain_pytorch_meter.py
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_memkit import MemoryMeter, format_bytes, training_state_tensors


def main(steps: int = 3) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # tensor_accounting="auto": the exact accountant on CPU; tensor_scope="process": its reading is
    # every live tensor storage of the process (found once by a gc sweep here, then followed)
    meter = MemoryMeter("cpu")
    readings = []
    for step in range(steps):
        x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
        # the gradients have no Python object for the sweeps to find: they come in with the
        # training state (counted once); everything the step allocates is counted as it happens
        with meter.measure(step, existing=training_state_tensors(model, [optimizer], (x, y))):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        reading = meter.last
        readings.append(reading)
        print(
            f"step {step}: peak {format_bytes(reading.peak_tensor_bytes)} ({reading.peak_tensor_bytes} B), "
            f"live at end {format_bytes(reading.tensor_bytes)} ({reading.tensor_bytes} B), host RSS "
            f"{format_bytes(reading.host_rss_bytes)}"
        )
    meter.shutdown()
    return readings


if __name__ == "__main__":
    main()
