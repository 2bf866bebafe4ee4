"""Real ranks for the per-rank checks: ``python tests/helpers/rank_run.py OUT STRATEGY WORLD PRECISION MODULE SHAPE SEQ
BATCH [OPTIONS]`` starts WORLD processes (gloo on CPU, a file store under OUT) that each set up a Llama-shaped
LightningModule as Lightning's strategy sets up a rank, run two training steps in Lightning's order, count their tensor
memory with :class:`rank_count.RankCounter` (no memkit code: memkit is not imported here) and write ``OUT/rank{r}.json``
with the rank's tensor peak over the steps, in bytes.

What each strategy's set-up does, after Lightning 2.6 (its own pieces where they are the thing measured):

- ``ddp``: ``DDPStrategy.setup``: the precision plugin's ``convert_module``, then
  ``DistributedDataParallel(module, device_ids=None, **OPTIONS)``; ``training_step`` through
  ``_DDPForwardRedirection``.
- ``fsdp``: ``configure_model`` under the precision's ``module_init_context``, ``FSDPStrategy.setup``'s
  ``convert_module``, then ``FullyShardedDataParallel(module, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
  mixed_precision=FSDPPrecision(precision).mixed_precision_config, sharding_strategy=FULL_SHARD,
  device_id=cpu, use_orig_params=True)`` (FSDPStrategy refuses a CPU accelerator, so its ``_setup_model`` is
  written out here); ``training_step`` through ``_ForwardRedirection``.
- ``model_parallel``: ``self.device_mesh`` = ``init_device_mesh("cpu", (WORLD, 1), ("data_parallel",
  "tensor_parallel"))`` as ModelParallelStrategy sets it, ``configure_model``, ``convert_module``;
  ``training_step`` called directly (the module shards itself).

The steps: ``training_step`` under the precision's ``forward_context``, ``optimizer_zero_grad``, ``backward``,
``optimizer.step()``; the peak counts from the first forward (the module's shards or replica, the optimizer, the
batch and, under DDP and FSDP, what the wrap left alive).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from rank_count import RankCounter  # noqa: E402

PRECISIONS = ("32-true", "bf16-true")


def launch(argv: list[str]) -> int:
    """Start WORLD ranks of this script and wait for all of them (the caller's timeout ends the session)."""
    out, world = argv[0], int(argv[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(rank), *argv], env=dict(env, LOCAL_RANK=str(rank)))
        for rank in range(world)
    ]
    codes = [rank.wait() for rank in ranks]
    if any(codes):
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signal.SIGKILL)
    os.makedirs(out, exist_ok=True)
    return max(codes)


def _precision_plugin(strategy: str, precision: str):
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, FSDPPrecision, HalfPrecision, Precision

    if strategy == "fsdp":
        return FSDPPrecision(precision)
    if strategy.startswith("deepspeed"):
        return DeepSpeedPrecision(precision)
    return HalfPrecision(precision) if precision != "32-true" else Precision()


def _module(name: str, shape: str, seq: int, batch: int):
    import llama_shapes

    return getattr(llama_shapes, name)(shape=shape, seq_len=seq, batch_size=batch)


def _setup(strategy: str, module, plugin, world: int, options: dict):
    """The rank's module as the strategy sets it up; returns what ``training_step`` runs through."""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    if strategy == "model_parallel":
        from torch.distributed.device_mesh import init_device_mesh

        module._device_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    if strategy in ("model_parallel", "fsdp"):
        with plugin.module_init_context():
            module.configure_model()
    plugin.convert_module(module)
    if strategy == "ddp":
        from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
        from torch.nn.parallel import DistributedDataParallel

        wrapper = DistributedDataParallel(module, device_ids=None, **options)
        return lambda *args: _DDPForwardRedirection()(wrapper, module, "training_step", *args)
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        wrapper = FullyShardedDataParallel(
            module,
            auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
            mixed_precision=plugin.mixed_precision_config,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            device_id=torch.device("cpu"),
            use_orig_params=True,
            **options,
        )
        return lambda *args: _ForwardRedirection()(wrapper, module, "training_step", *args)
    return module.training_step


def _deepspeed_engine(strategy: str, module, precision: str, options: dict):
    """DeepSpeed's engine as Lightning's DeepSpeedStrategy initialises it: its default config for the stage (with the
    precision's ``bf16`` section), the module's ``configure_optimizers`` optimizer; ``training_step`` through the
    engine's forward (Lightning's forward redirection)."""
    import deepspeed
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    config = DeepSpeedStrategy(stage=int(strategy[-1]), **options).config
    config["train_micro_batch_size_per_gpu"] = module.batch_size
    if precision.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    optimizer = module.configure_optimizers()
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    return engine, lambda *args: _ForwardRedirection()(engine, module, "training_step", *args)


def _run_deepspeed(strategy: str, module, plugin, precision: str, options: dict, counter) -> None:
    engine, training_step = _deepspeed_engine(strategy, module, precision, options)
    batch_data = plugin.convert_input(next(iter(module.train_dataloader())))
    counter.start_peak()
    for step in range(2):
        loss = training_step(batch_data, step)
        engine.backward(loss)
        del loss
        engine.step()


def run_rank(rank: int, argv: list[str]) -> None:
    out, strategy, world, precision, name, shape, seq, batch = argv[:8]
    options = json.loads(argv[8]) if len(argv) > 8 else {}
    world, seq, batch = int(world), int(seq), int(batch)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    plugin = _precision_plugin(strategy, precision)
    module = _module(name, shape, seq, batch)
    counter = RankCounter()
    counter.hold([*module.parameters(), *module.buffers()])
    with counter:
        if strategy.startswith("deepspeed"):
            _run_deepspeed(strategy, module, plugin, precision, options, counter)
        else:
            _run_steps(strategy, module, plugin, world, options, counter)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"rank": rank, "peak_bytes": counter.peak_bytes}, file)
    dist.barrier()
    dist.destroy_process_group()


def _run_steps(strategy: str, module, plugin, world: int, options: dict, counter) -> None:
    training_step = _setup(strategy, module, plugin, world, options)
    optimizer = module.configure_optimizers()
    batch_data = plugin.convert_input(next(iter(module.train_dataloader())))
    counter.start_peak()
    for step in range(2):
        with plugin.forward_context():
            loss = training_step(batch_data, step)
        module.optimizer_zero_grad(0, step, optimizer)
        module.backward(loss)
        del loss
        optimizer.step()


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        run_rank(int(sys.argv[2]), sys.argv[3:])
    else:
        sys.exit(launch(sys.argv[1:]))
