"""The batch-size search: an estimate-guided core (no Lightning), a CPU memory budget that fails like an
out-of-memory error, and the Lightning trial runner behind MaxBatchSize / find_max_batch_size.

This layer never imports lightning_memkit.callbacks: the callback passes the search what it needs
(the checkpointing policy the trials train with), and ``find_max_batch_size`` lives beside the callback.

Import each name from the module that defines it."""
