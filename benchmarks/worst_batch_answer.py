"""The largest batch predicted for a padded-text classifier (5.0M parameters, lengths 16-256, argmax metrics) at a
512 MiB CPU budget is the largest whose worst-length step fits: estimated on the worst batch of that size and one
more, and a real CPU step on the first.

Run:  python benchmarks/worst_batch_answer.py
"""

from __future__ import annotations

from lightning_memkit import estimate_memory, find_worst_batch, measure_training_step, predict_max_batch_size
from lightning_memkit.zoo_variable import PaddedTextClassifier


def main() -> None:
    model = PaddedTextClassifier(d_model=256, layers=6, dim_feedforward=1024)
    budget = 512 * 2**20
    target = 0.95 * budget  # predict_max_batch_size's default margin
    prediction = predict_max_batch_size(model, budget, device="cpu")
    size = prediction.batch_size
    print(f"answer {size} on {prediction.batch_shapes} ({prediction.batch_note})")
    worst = find_worst_batch(model.train_dataloader())
    at_size = estimate_memory(model, batch=worst.at(size), device="cpu").peak_bytes
    one_more = estimate_memory(model, batch=worst.at(size + 1), device="cpu").peak_bytes
    print(f"estimate at {size}: {at_size} B <= {target:.0f}: {at_size <= target}")
    print(f"estimate at {size + 1}: {one_more} B > {target:.0f}: {one_more > target}")
    real = measure_training_step(model, batch=worst.at(size)).peak_bytes
    print(f"real CPU step at {size}: {real} B, {at_size - real:+d} B from the estimate; fits: {real <= target}")


if __name__ == "__main__":
    main()
