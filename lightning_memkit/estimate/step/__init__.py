"""The estimated training step: one request run (runner) under a with-block's settings (settings), in Lightning's
order (lightning_step, manual_step, trainer_stand_in), counted by the step's accountant (step_accountant,
offload_model) into a MemoryEstimate (memory_estimate; hook_errors names the hook that failed). Import each name from
its module."""
