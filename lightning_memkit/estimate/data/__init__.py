"""Where the estimate's batch comes from: the train loader re-batched to any size (batches) and the worst batch the
data can produce (worst_batch). Import each name from its module."""
