"""The public API, listed: a refactor that moves code between modules must leave ``lightning_memkit.__all__`` and
where each name comes from (``from lightning_memkit import X``) as they are. Adding a name means adding it here."""

from __future__ import annotations

import inspect

import lightning_memkit

PUBLIC = [
    "ActivationCheckpointing",
    "ActivationOffload",
    "AutoFit",
    "BudgetExceededError",
    "Candidate",
    "CheckpointBudget",
    "CreationRecorder",
    "DistributedEstimate",
    "DoctorReport",
    "DoctorSession",
    "LayerTrace",
    "LayerTraceResult",
    "LayerTracer",
    "LeakWatcher",
    "MaxBatchSize",
    "MemkitError",
    "MemoryBudget",
    "MemoryDoctor",
    "MemoryEstimate",
    "MemoryMeter",
    "MemoryTracker",
    "Mode",
    "Plan",
    "PlanError",
    "PlanRow",
    "RunSummary",
    "StepReading",
    "TensorAccountant",
    "TraceEvent",
    "WorstBatch",
    "apply_checkpointing",
    "compare_modes",
    "estimate_distributed_memory",
    "estimate_memory",
    "find_max_batch_size",
    "find_worst_batch",
    "format_bytes",
    "is_out_of_memory",
    "measure_training_step",
    "model_state_bytes",
    "parse_bytes",
    "parse_mode",
    "plan_fit",
    "predict_max_batch_size",
    "trace_step",
    "training_state_tensors",
]

#: the callables' parameters (names and kinds) users pass by keyword: a rename breaks their code
SIGNATURES = {
    "estimate_memory": [
        "module",
        "batch_size",
        "batch",
        "mode",
        "device",
        "optimizer",
        "loss_fn",
        "datamodule",
        "trainer",
        "gpu",
    ],
    "find_worst_batch": ["loader", "batch_size", "size_of", "max_samples"],
}


def test_the_public_names_are_these():
    assert sorted(lightning_memkit.__all__) == sorted(PUBLIC)
    assert len(set(lightning_memkit.__all__)) == len(lightning_memkit.__all__)
    for name in PUBLIC:
        assert getattr(lightning_memkit, name) is not None


def test_the_keyword_arguments_users_pass_are_these():
    for name, parameters in SIGNATURES.items():
        assert list(inspect.signature(getattr(lightning_memkit, name)).parameters) == parameters, name
