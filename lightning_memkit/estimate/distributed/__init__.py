"""Per-rank memory under DDP, FSDP, FSDP2 and DeepSpeed ZeRO, estimated without the cluster: each rank's estimate
(per_rank), what a strategy shards (sharding) and FSDP2's own ``fully_shard`` on the fake copy (fsdp2). Import each
name from its module."""
