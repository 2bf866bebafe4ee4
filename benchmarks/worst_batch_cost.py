"""How long finding the worst batch takes on a 100,000-sample padded-text dataset: every sample sized, and with a
named size field. Prints seconds and the batch found.

Run:  python benchmarks/worst_batch_cost.py
"""

from __future__ import annotations

import time

from lightning_memkit import find_worst_batch
from lightning_memkit.zoo_variable import PaddedTextDataModule


def main() -> None:
    data = PaddedTextDataModule(batch_size=32, train_size=100_000)
    for label, options in (("every sample sized", {}), ("size_of='lengths'", {"size_of": "lengths"})):
        started = time.perf_counter()
        worst = find_worst_batch(data.train_dataloader(), **options)
        print(f"{label}: {time.perf_counter() - started:.2f} s; {worst.describe()}")


if __name__ == "__main__":
    main()
