"""Per-rank memory under DDP, FSDP, FSDP2 and DeepSpeed ZeRO, estimated without the cluster: each rank's estimate
(per_rank) is one fake step of one rank (rank_step) set up as its strategy sets up a rank: the module's own
``configure_model`` (user_model), FSDP1 and FSDP2 by their own code on a fake process group (fsdp1, fsdp2,
fake_group), DDP's buckets and DeepSpeed's ZeRO by event models from their source (ddp, deepspeed_zero,
deepspeed_stage3), with the strategy's settings (strategy_options); what a strategy shards, by the ZeRO paper's
arithmetic (sharding). Import each name from its module."""
