"""A plan on several devices (``plan_fit(world_size=N)``, ``memkit plan --world-size N``, ``--max-world-size``): the
candidates per strategy, what each rank sends by hand, a 2-rank CPU plan proved by a real 2-process fit of its own
LightningCLI config, and a 7B full fine-tune on 8 x 80 GiB built on the meta device."""

from __future__ import annotations

import json
import re
import textwrap
import time

import pytest
import torch

from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
from lightning_memkit.estimate.step.settings import accumulating, observing_ops
from lightning_memkit.plan import Candidate, PlanError, plan_fit
from lightning_memkit.plan.rank_space import (
    ParameterCounts,
    comm_bytes,
    optimizer_share,
    parse_strategies,
    rank_space,
    world_sizes,
)
from lightning_memkit.plan.time_model import INTERCONNECTS, OpCosts, TimeModel, roofline_for
from lightning_memkit.units import format_bytes
from lightning_memkit.zoo import DemoTransformer
from tests.helpers.event_files import read_scalars
from tests.helpers.processes import run_script

MiB, GiB = 1 << 20, 1 << 30
WRAP = {torch.nn.TransformerEncoderLayer}


# ------------------------------------------------------------------------------------------ the space and the wire
def test_each_strategy_sends_its_collectives_bytes_by_hand():
    """What one rank sends per optimizer step on 4 devices, written out: DDP all-reduces the trainable gradients once
    (twice 3/4 of their bytes, fp32 under autocast); FSDP and ZeRO-3 gather every parameter twice and reduce-scatter
    the gradients per micro-batch (in bf16 under Lightning's FSDP mixed precision, fp32 for FSDP2's own shards);
    ZeRO-2 reduce-scatters the gradients per micro-batch and gathers the updated weights once."""
    counts = ParameterCounts(total=1000, trainable=600)
    share = 3 / 4

    def sent(strategy: str, precision: str = "bf16-mixed", accumulation: int = 2) -> int:
        return comm_bytes(Candidate(2, accumulation, precision, strategy=strategy, world_size=4), counts)

    assert sent("ddp") == int(2 * share * 600 * 4)
    assert sent("ddp", "bf16-true") == int(2 * share * 600 * 2)
    assert sent("ddp", accumulation=8) == sent("ddp")  # Lightning skips the sync of the accumulated micro-batches
    assert sent("fsdp") == int(2 * (2 * share * 1000 * 2 + share * 600 * 2))
    assert sent("deepspeed_stage_3") == sent("fsdp")
    assert sent("model_parallel") == int(2 * (2 * share * 1000 * 4 + share * 600 * 4))
    assert sent("deepspeed_stage_2") == int(2 * share * 600 * 2 + share * 600 * 2)
    assert sent("fsdp", "32-true") == int(2 * (2 * share * 1000 * 4 + share * 600 * 4))
    assert comm_bytes(Candidate(2, 2), counts) == 0  # one device
    layers = torch.nn.Sequential(torch.nn.Linear(10, 60), torch.nn.Linear(60, 4))
    layers[1].requires_grad_(False)
    assert ParameterCounts.of(layers) == ParameterCounts(total=10 * 60 + 60 + 60 * 4 + 4, trainable=10 * 60 + 60)


def test_the_candidates_of_a_world_size_split_the_batch_evenly_under_each_strategy():
    space = rank_space(
        32,
        4,
        ("ddp", "fsdp"),
        modes=("micro_batch",),
        device_type="cuda",
        precision="32-true",
        can_checkpoint=False,
        can_accumulate=True,
    )
    assert {c.strategy for c in space} == {"ddp", "fsdp"} and all(c.world_size == 4 for c in space)
    assert all(c.micro_batch * c.accumulation == 8 and c.effective_batch == 32 for c in space)
    assert space[0] == Candidate(8, 1, strategy="ddp", world_size=4)  # the per-rank batch as is, first
    assert Candidate(2, 4, strategy="fsdp", world_size=4).describe() == "fsdp x 4, micro 2 x 4, 32-true"
    assert world_sizes(16, 8) == [1, 2, 4, 8] and world_sizes(12, 8) == [1, 2, 4] and world_sizes(12, 3) == [1, 2, 3]
    # on CPU processes only what Lightning runs there: DDP, and FSDP2 for a module that shards itself
    assert parse_strategies(None, can_model_parallel=False, device_type="cpu") == ("ddp",)
    assert parse_strategies(None, can_model_parallel=True, device_type="cuda") == (
        "ddp",
        "deepspeed_stage_2",
        "fsdp",
        "model_parallel",
        "deepspeed_stage_3",
    )
    with pytest.raises(ValueError, match="'fsdp' does not run on cpu processes"):
        parse_strategies("fsdp", can_model_parallel=False, device_type="cpu")
    with pytest.raises(ValueError, match="needs the module to shard itself in configure_model"):
        parse_strategies("model_parallel", can_model_parallel=False)
    with pytest.raises(ValueError, match="choose from ddp"):
        parse_strategies("horovod", can_model_parallel=False)


def test_bad_device_arguments_are_refused_with_what_to_do():
    module = DemoTransformer(dropout=0.0, batch_size=8)
    with pytest.raises(PlanError, match=r"world_size=0: give a positive number of devices"):
        plan_fit(module, world_size=0, device="cpu", device_memory="1GiB", verbose=False)
    with pytest.raises(PlanError, match="give one"):
        plan_fit(module, world_size=2, max_world_size=4, device="cpu", device_memory="1GiB", verbose=False)
    with pytest.raises(PlanError, match="split evenly over world_size=3"):
        plan_fit(module, batch_size=16, world_size=3, device="cpu", device_memory="1GiB", verbose=False)
    with pytest.raises(PlanError, match="is for several devices"):
        plan_fit(module, strategy="ddp", device="cpu", device_memory="1GiB", verbose=False)
    with pytest.raises(PlanError, match="interconnect='ethernet'"):
        plan_fit(module, world_size=2, interconnect="ethernet", gpu="h100", verbose=False)
    assert INTERCONNECTS["nvlink"] > INTERCONNECTS["infiniband"] > INTERCONNECTS["pcie"]


# ------------------------------------------------------------------------------------------ what a plan leaves out
def test_a_strategy_whose_model_states_alone_exceed_the_budget_steps_once(tmp_path):
    """DDP keeps every model state on every rank: once one rank step shows the parameters, AdamW's state and the
    gradients above the budget (its peak in the second step's forward, where the first step's gradients still live),
    no micro-batch or checkpointing of that strategy and precision can fit, and its other rows say so without a step.
    The floor is the analytic count: 4 bytes per fp32 parameter, 4 of its gradient, 8 of AdamW's two moments, 4 per
    parameter tensor of its step counter; every row's own estimate is at least that (what makes the rows' "does not
    fit" true)."""
    module = DemoTransformer(dropout=0.0, batch_size=8)
    parameters = list(module.parameters())
    elements = sum(p.numel() for p in parameters)
    floor = 4 * elements + 4 * elements + 8 * elements + 4 * len(parameters)
    plan = plan_fit(
        module,
        batch_size=8,
        world_size=2,
        modes="micro_batch,checkpoint",
        device="cpu",
        device_memory=floor - 1,
        verbose=False,
    )
    estimated = [row for row in plan.rows if row.predicted_peak_bytes is not None]
    floored = [row for row in plan.rows if row.predicted_peak_bytes is None]
    assert [row.candidate for row in estimated] == [Candidate(4, 1, strategy="ddp", world_size=2)]
    assert len(floored) == 5 and not any(row.fits for row in plan.rows)  # micro 4, 2, 1 with and without checkpoints
    expected = f"does not fit: its model states alone need {format_bytes(floor)} whatever the micro-batch"
    assert all(row.note.startswith(expected) for row in floored), floored[0].note
    assert "(parameters, optimizer_state, gradients in the step of ddp x 2, micro 4 x 1, 32-true)" in floored[0].note
    assert plan.best is None and "no candidate is predicted to fit" in " ".join(plan.notes)
    for row in floored:
        c = row.candidate
        with accumulating(min(c.accumulation, 2)):
            own = estimate_distributed_memory(
                module, c.micro_batch, strategy="ddp", world_size=2, device="cpu", mode=c.mode
            )
        assert own.peak_bytes >= floor, (c.describe(), own.peak_bytes, floor)


def test_a_smaller_micro_batch_is_never_predicted_faster_so_several_devices_stop_at_the_first_that_fits():
    """On several devices nothing is trialled, so each strategy and mode stops at its largest micro-batch that fits:
    under the time model a smaller one (the same samples in more steps) is never faster. Checked on the model's own
    fake steps for an H100, per strategy and precision: the predicted step grows as the micro-batch shrinks. A CPU
    plan of the same model estimates one row per mode, and says how many it left out."""
    module = DemoTransformer(dropout=0.0, batch_size=8)
    counts = ParameterCounts.of(module)
    model = TimeModel(roofline_for("h100"), INTERCONNECTS["nvlink"])
    for strategy in ("ddp", "fsdp", "deepspeed_stage_2"):
        for precision in ("32-true", "bf16-mixed"):
            steps = []
            for micro in (4, 2, 1):
                candidate = Candidate(micro, 4 // micro, precision, strategy=strategy, world_size=2)
                costs = OpCosts()
                with accumulating(min(candidate.accumulation, 2)), observing_ops(costs):
                    estimate_distributed_memory(
                        module, micro, strategy=strategy, world_size=2, gpu="h100", mode=candidate.mode, wrap=WRAP
                    )
                sent = comm_bytes(candidate, counts)
                terms = model.step_terms(costs, candidate.accumulation, 0, sent, optimizer_share(candidate))
                steps.append(terms.total_s)
            assert steps == sorted(steps) and steps[0] < steps[-1], (strategy, precision, steps)
    plan = plan_fit(module, batch_size=8, world_size=2, modes="micro_batch", device="cpu", device_memory="1GiB")
    assert [row.candidate for row in plan.rows] == [Candidate(4, 1, strategy="ddp", world_size=2)]
    assert plan.best == Candidate(4, 1, strategy="ddp", world_size=2)
    assert "2 smaller micro-batches not estimated: below one that fits in the same strategy and mode" in " ".join(
        plan.notes
    )


# ------------------------------------------------------------------------------------------ a 2-rank CPU plan, proved
SHARDED = textwrap.dedent(
    '''
    from lightning_memkit.zoo import DemoTransformer


    class ShardedTransformer(DemoTransformer):
        """DemoTransformer sharded as Lightning's ModelParallelStrategy documents FSDP2: the blocks, then the root."""

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)
    '''
)

FIT = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    from lightning.pytorch.cli import LightningCLI
    from lightning_memkit import MemoryTracker
    from sharded import ShardedTransformer

    out, config = sys.argv[1], sys.argv[2]
    tracker = MemoryTracker(per_rank=True, verbose=False, tensor_peak_every_n_steps=1)
    cli = LightningCLI(
        ShardedTransformer,
        run=False,
        save_config_callback=None,
        args=["--config", config, "--trainer.accelerator=cpu", "--trainer.max_steps=2",
              f"--trainer.default_root_dir={out}",
              "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
              "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
              "--trainer.num_sanity_val_steps=0", "--trainer.log_every_n_steps=1", "--model.dropout=0.0"],
        trainer_defaults={"callbacks": [tracker]},
    )
    cli.trainer.fit(cli.model)
    data = cli.model.trainer.train_dataloader.dataset
    dataset_bytes = sum(t.numel() * t.element_size() for t in vars(data).values() if hasattr(t, "numel"))
    with open(os.path.join(out, f"rank{cli.trainer.global_rank}.json"), "w") as file:
        json.dump({"dataset_bytes": dataset_bytes, "strategy": type(cli.trainer.strategy).__name__}, file)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_rank_cpu_plan_is_proved_by_a_real_two_process_fit_of_its_own_config(tmp_path, monkeypatch):
    """The per-rank batch as is: DDP's rank of the same model unsharded does not fit the budget, FSDP2's (the module
    shards itself) does; the plan chooses FSDP2 on 2 devices, and its own LightningCLI YAML trains 2 real gloo
    processes whose every rank's tensor peak (MemoryTracker, the dataset the loader holds left out) stays within the
    budget, as its estimate said. The module's configure_model needs ModelParallelStrategy's device mesh, so its DDP
    rows are not estimated (a real DDP fit fails in configure_model the same way) and say why."""
    (tmp_path / "sharded.py").write_text(SHARDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    from sharded import ShardedTransformer

    module = ShardedTransformer(dropout=0.0, batch_size=16)
    unsharded = DemoTransformer(dropout=0.0, batch_size=16)
    ddp = estimate_distributed_memory(unsharded, 16, strategy="ddp", world_size=2, device="cpu").peak_bytes
    wrap = {torch.nn.TransformerEncoderLayer}
    fsdp2 = estimate_distributed_memory(module, 16, strategy="model_parallel", world_size=2, wrap=wrap, device="cpu")
    budget = (ddp + fsdp2.peak_bytes) // 2
    assert fsdp2.peak_bytes < budget < ddp  # what this test is about
    plan = plan_fit(
        module, batch_size=32, world_size=2, modes="baseline", device="cpu", device_memory=budget, verbose=False
    )
    assert plan.world_size == 2 and plan.trials == 0
    assert plan.best == Candidate(16, 1, strategy="model_parallel", world_size=2)
    assert plan.best_row.predicted_peak_bytes == fsdp2.required_bytes <= budget
    assert "predicted, not trialled" in plan.reason
    ddp_notes = {row.note for row in plan.rows if row.candidate.strategy == "ddp"}
    assert ddp_notes and all(
        note.startswith("not estimated: ShardedTransformer.configure_model failed") for note in ddp_notes
    )
    arguments = plan.trainer_arguments()
    assert arguments["devices"] == 2 and type(arguments["strategy"]).__name__ == "ModelParallelStrategy"
    config = tmp_path / "plan.yaml"
    config.write_text(plan.yaml())
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    run_script([str(script), str(tmp_path), str(config)], cwd=str(tmp_path), timeout=420, ranks=2)
    scalars = read_scalars(str(tmp_path / "lightning_logs" / "version_0"))
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["strategy"] == "ModelParallelStrategy"
        peaks = [round(v * MiB) for _, v in scalars[f"memory/train/rank{rank}/peak_tensor_MiB"]]
        step_peak = max(peaks) - measured["dataset_bytes"]
        assert step_peak <= budget, (rank, step_peak, budget)
        assert abs(step_peak - fsdp2.peak_bytes) / step_peak < 1e-3, (rank, step_peak, fsdp2.peak_bytes)


# ------------------------------------------------------------------------------------------ 7B on 8 x 80 GiB
@pytest.mark.extended  # a 7B rank step per strategy and mode until one fits: about a minute on 2 cores
@pytest.mark.timeout(900)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_7b_full_fine_tune_on_eight_80gib_gpus_gets_a_configuration_that_fits_with_its_terms(tmp_path, capsys):
    """`memkit plan --world-size 8 --meta-init` for a Llama-2-7B-shaped full fine-tune in bf16-mixed: a configuration
    whose per-rank estimate fits 80 GiB (5% kept free), the terms of its step printed, the Trainer's strategy and YAML;
    DDP cannot fit (16 bytes per parameter of model states on every rank: 107.8 GB)."""
    from lightning_memkit.cli import main

    out_json = tmp_path / "plan.json"
    arguments = [
        "plan",
        "tests/helpers/llama_shapes.py:LlamaFineTune",
        "--meta-init",
        "--gpu",
        "h100",
        "--device-memory",
    ]
    arguments += ["80GiB", "--world-size", "8", "--batch-size", "16", "--modes", "micro_batch,checkpoint,bf16"]
    started = time.perf_counter()
    status = main([*arguments, "--json", str(out_json)])
    seconds = time.perf_counter() - started
    out = capsys.readouterr().out
    assert status == 0, out[-3000:]
    data = json.loads(out_json.read_text())
    best = next(row for row in data["rows"] if row["configuration"] == data["best"])
    assert best["fits"] and best["predicted_peak_bytes"] <= 0.95 * 80 * GiB
    parameters = 6_738_415_616  # Llama-2-7B: 32 layers of 4 x 4096^2 + 3 x 4096 x 11008 + 2 norms, embeddings, head
    assert not any(row["fits"] for row in data["rows"] if row["configuration"].startswith("ddp"))
    assert 16 * parameters > 0.95 * 80 * GiB  # why: DDP keeps every model state on every rank
    assert re.search(r"compute +recompute +sent +comm", out)
    assert re.search(rf"^best: {re.escape(data['best'])}: the fastest predicted step of the \d+ that fit", out, re.M)
    assert "Trainer(devices=8, strategy=" in out and "devices: 8" in data["yaml"]
    print(f"7B on 8 GPUs planned in {seconds:.0f} s")
