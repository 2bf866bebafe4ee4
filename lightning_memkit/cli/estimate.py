"""``memkit estimate FILE.py:Module``: predicted peak and largest batch per mode, on fake tensors (no GPU needed);
per rank under multi-GPU strategies with the fewest GPUs that fit (``--strategy``), and a real check (``--check``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from lightning_memkit.cli.common import add_init_arguments

__all__ = ["add_parser", "run", "KERNELS_PREFIX", "world_sizes_tried"]

#: the estimate's note that lists the CUDA kernels assumed (estimate/cuda_kernels.py writes it)
KERNELS_PREFIX = "CUDA kernels assumed: "
#: the largest world size ``--strategy`` tries for its "min GPUs" answer unless ``--max-world-size`` says otherwise
DEFAULT_MAX_WORLD_SIZE = 1024


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate", help="will it fit? predict a training step's memory and the largest batch, per mode (and per strategy)",
        description="Build the LightningModule (with --init-args), run its training step on fake tensors (no real memory, "
                    "no GPU) and print, per mode, the predicted peak allocated and reserved memory at its batch size and "
                    "the largest batch that fits. With --strategy: one rank's memory under each strategy and mode, and the "
                    "fewest GPUs that fit. With --check (on a GPU): two real training steps, estimate against measured.")
    parser.add_argument("module", help="FILE.py:ModuleClass or package.module:ModuleClass (built with --init-args)")
    add_init_arguments(parser, datamodule=True)
    parser.add_argument("--device-memory", default=None, help="device memory, e.g. 16GiB or 80GB (default: this machine's GPU)")
    # '-16GiB' would otherwise be taken for an unknown option ("expected one argument"): let every value that
    # starts with '-' and a digit reach the option, so that a negative size gets its own clear message
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--modes", default="baseline",
                        help="comma-separated modes, e.g. baseline,amp,checkpoint,amp+checkpoint (default: baseline)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="target device type: cuda (CUDA kernels + allocator model) or cpu (default: cuda)")
    parser.add_argument("--gpu", default=None, metavar="GPU",
                        help="the GPU to model with --device cuda: a name (h100, a100, v100, l4, ...) or a compute capability "
                             "(sm90, 8.0); it picks the attention kernel and the cuBLAS workspace (default: this machine's "
                             "GPU, else h100)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="estimate at this batch size, per rank with --strategy (default: the module's)")
    parser.add_argument("--margin", type=float, default=0.05, help="fraction of device memory kept free (default: 0.05)")
    parser.add_argument("--size-of", default=None, metavar="ATTRIBUTE",
                        help="the train dataset's attribute holding each sample's size (e.g. lengths): the worst batch is "
                             "then found from it without loading every sample (default: every sample is sized, or a fixed "
                             "subset of a dataset too large or slow to size whole)")
    parser.add_argument("--strategy", default=None, metavar="NAMES",
                        help="comma-separated multi-GPU strategies, e.g. ddp,fsdp,deepspeed_stage_3: one rank's memory on "
                             "--world-size ranks per strategy and mode, and the fewest GPUs that fit")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (GPUs) for --strategy (default: 8)")
    parser.add_argument("--max-world-size", type=int, default=DEFAULT_MAX_WORLD_SIZE,
                        help="the 'min GPUs' answer tries 1, 2, 4, ... up to this many GPUs "
                             f"(default: {DEFAULT_MAX_WORLD_SIZE})")
    parser.add_argument("--wrap", default=None, metavar="CLASSES",
                        help="FSDP units for --strategy fsdp*/model_parallel: comma-separated class names of the module's "
                             "layers (your auto_wrap_policy), e.g. TransformerEncoderLayer (default: the whole model is one unit)")
    parser.add_argument("--meta-init", action="store_true",
                        help="build the module on the meta device (no weights, no host memory, no init time): for models "
                             "larger than this machine; the estimate is the same")
    parser.add_argument("--check", action="store_true",
                        help="on a GPU: also train two real steps per mode (a Trainer on a copy of the module) and print the "
                             "estimate against torch.cuda.max_memory_allocated/reserved, with the error")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this JSON file")
    parser.set_defaults(run=run)


def _memory(text: str) -> int:
    from lightning_memkit.cli.common import CliError
    from lightning_memkit.units import parse_bytes

    if text.strip().startswith("-"):
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    try:
        memory = parse_bytes(text)
    except ValueError as error:
        raise CliError(f"--device-memory: {error}") from None
    if memory <= 0:
        raise CliError(f"--device-memory {text}: a memory size is positive; write e.g. --device-memory 16GiB")
    if re.fullmatch(r"\s*[0-9.eE+]+\s*", text):
        # a device's memory is never a few bytes: a bare number is a unit left out, not a byte count
        number = text.strip()
        raise CliError(f"--device-memory {number} has no unit; write --device-memory {number}GiB (or {number}GB, "
                       f"decimal; a byte count as {number}B)")
    return memory


def _other_modes_hint(mode: str) -> str:
    """How to ask this command for the modes that need less memory than ``mode``."""
    others = [name for name in ("bf16", "checkpoint", "bf16+checkpoint") if name != mode]
    return "try " + " or ".join(f"--modes {name}" for name in others)


def _gpu(args: argparse.Namespace) -> Any:
    """The ``--gpu`` target (a :class:`GpuTarget`), or ``None`` for the default."""
    from lightning_memkit.cli.common import CliError
    from lightning_memkit.estimate.cuda_kernels import GpuTarget

    if args.gpu is None:
        return None
    if args.device != "cuda":
        raise CliError(f"--gpu {args.gpu} picks CUDA kernels; it needs --device cuda (or drop --gpu for a CPU estimate)")
    try:
        return GpuTarget.parse(args.gpu)
    except ValueError as error:
        raise CliError(f"--gpu: {error}") from None


def _strategies(args: argparse.Namespace) -> list[str]:
    from lightning_memkit.cli.common import CliError
    from lightning_memkit.estimate.distributed import STRATEGIES, sharding_of

    if args.strategy is None:
        for flag, value in (("--world-size", args.world_size), ("--wrap", args.wrap)):
            if value is not None:
                raise CliError(f"{flag} is for multi-GPU estimates: give --strategy too, e.g. --strategy fsdp {flag} {value}")
        return []
    names = [name.strip() for name in args.strategy.split(",") if name.strip()]
    if not names:
        raise CliError(f"--strategy {args.strategy!r}: give one or more of: {', '.join(STRATEGIES)}")
    if args.world_size is None:
        args.world_size = 8
    if args.world_size < 1:
        raise CliError(f"--world-size {args.world_size}: the number of ranks is at least 1, e.g. --world-size 8")
    if args.max_world_size < 1:
        raise CliError(f"--max-world-size {args.max_world_size}: give at least 1, e.g. --max-world-size {DEFAULT_MAX_WORLD_SIZE}")
    canonical = []
    for name in names:
        try:
            canonical.append(sharding_of(name, args.world_size).strategy)
        except ValueError:
            raise CliError(f"--strategy {name}: unknown strategy; choose from: {', '.join(STRATEGIES)}") from None
    return list(dict.fromkeys(canonical))


def _wrap_classes(module: Any, text: str | None) -> set[type] | None:
    """The module's layer classes named by ``--wrap`` (matched by class name over its submodules)."""
    from lightning_memkit.cli.common import CliError

    if text is None:
        return None
    by_name: dict[str, type] = {}
    for each in module.modules():
        by_name.setdefault(type(each).__name__, type(each))
    classes = set()
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name not in by_name:
            raise CliError(f"--wrap {name}: {type(module).__name__} has no layer of that class; its layer classes are: "
                           f"{', '.join(sorted(by_name))}")
        classes.add(by_name[name])
    return classes


def world_sizes_tried(limit: int) -> list[int]:
    """The world sizes the "min GPUs" answer tries: 1, 2, 4, ... up to ``limit`` (``limit`` itself included)."""
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return sizes


def _check_refusal(args: argparse.Namespace, gpu: Any) -> None:
    """``--check`` needs a CUDA target, one GPU here, and the estimate made for that GPU."""
    import torch

    from lightning_memkit.cli.common import CliError
    from lightning_memkit.estimate.cuda_kernels import GpuTarget

    if args.strategy is not None:
        raise CliError("--check trains on this machine's one GPU; it does not run --strategy (drop one of them)")
    if args.meta_init:
        raise CliError("--check trains real steps, and a module built with --meta-init has no weights; drop one of them")
    if args.device != "cuda":
        raise CliError("--check measures a real step on a GPU against a CUDA estimate; use --device cuda (the default)")
    if not torch.cuda.is_available():
        raise CliError("--check trains two real steps on a GPU, and torch sees none here (torch.cuda.is_available() is "
                       "False); drop --check, or run it on a machine with a GPU and a CUDA build of torch")
    here = GpuTarget.parse(None)
    if gpu is not None and gpu.capability != here.capability:
        raise CliError(f"--check measures on this machine's {here.name} (sm{here.sm}); --gpu {args.gpu} would estimate "
                       f"another GPU's kernels: drop --gpu or give --gpu sm{here.sm}")


def run(args: argparse.Namespace) -> int:
    from lightning_memkit.cli.common import CliError, build_instance, json_object, load_object
    from lightning_memkit.estimate.predict import device_capacity_bytes
    from lightning_memkit.modes.mode import parse_modes

    try:
        modes = parse_modes(args.modes)
        gpu = _gpu(args)
        strategies = _strategies(args)
        if args.check:
            _check_refusal(args, gpu)
        if args.device_memory is not None:
            memory = _memory(args.device_memory)
        else:
            try:
                memory = device_capacity_bytes(args.device)
            except ValueError:
                raise CliError(f"cannot read the memory of a {args.device} device here; "
                               "give --device-memory, e.g. --device-memory 16GiB") from None
        if not 0 <= args.margin < 1:
            raise CliError(f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.05")
        if args.batch_size is not None and args.batch_size < 1:
            raise CliError(f"--batch-size {args.batch_size}: give a positive integer")
        cls = load_object(args.module)
        if args.meta_init:
            import torch

            with torch.device("meta"):
                module = build_instance(cls, json_object(args.init_args, "--init-args"))
        else:
            module = build_instance(cls, json_object(args.init_args, "--init-args"))
        import lightning.pytorch as pl

        if not isinstance(module, pl.LightningModule):
            raise CliError(f"{args.module} is not a LightningModule class; memkit estimate needs one (for a plain nn.Module "
                           "call lightning_memkit.estimate_memory(module, batch=..., optimizer=...) from Python)")
        datamodule = None
        if args.datamodule:
            datamodule = build_instance(load_object(args.datamodule), json_object(args.datamodule_args, "--datamodule-args"),
                                        what="datamodule")
        elif getattr(type(module), "train_dataloader", None) is pl.LightningModule.train_dataloader:
            raise CliError(f"{type(module).__name__} defines no train_dataloader(); give the datamodule that feeds it with "
                           "--datamodule FILE.py:DataModuleClass (memkit estimate takes one batch from it and re-shapes it "
                           "to --batch-size)")
        wrap = _wrap_classes(module, args.wrap)
    except (CliError, ValueError) as error:
        print(f"memkit estimate: {error}", file=sys.stderr)
        return 2
    if strategies:
        return _run_distributed(args, module, datamodule, modes, strategies, memory, gpu, wrap)
    return _run_single(args, module, datamodule, modes, memory, gpu)


# ------------------------------------------------------------------------------------------ one GPU
def _figures(estimate: Any) -> tuple[int, int | None, int]:
    """(allocated, reserved, device needs) in bytes: the CUDA allocator view's peaks, or the tensor peak on CPU."""
    if estimate.cuda is None:
        return estimate.peak_bytes, None, estimate.required_bytes
    return estimate.cuda.peak_allocated_bytes, estimate.cuda.peak_reserved_bytes, estimate.required_bytes


def _kernels_and_notes(notes_by_mode: list[tuple[str, list[str]]]) -> list[str]:
    """The lines under a table: the CUDA kernels each mode assumed (modes that assumed the same share a
    line), then every other note once."""
    kernels: dict[str, list[str]] = {}
    others: dict[str, None] = {}
    for mode, notes in notes_by_mode:
        for note in notes:
            if note.startswith(KERNELS_PREFIX):
                kernels.setdefault(note[len(KERNELS_PREFIX):], []).append(mode)
            else:
                others[note] = None
    lines = [f"kernels assumed ({', '.join(dict.fromkeys(names))}): {text}" for text, names in kernels.items()]
    return lines + [f"note: {note}" for note in others]


def _target_words(args: argparse.Namespace, gpu: Any) -> str:
    if args.device != "cuda":
        return args.device
    from lightning_memkit.estimate.cuda_kernels import GpuTarget

    target = gpu if gpu is not None else GpuTarget.parse(None)
    return f"cuda ({target.name}, sm{target.sm})"


def _run_single(args, module, datamodule, modes, memory, gpu) -> int:
    from lightning_memkit.estimate import DoesNotFitError, EstimateError, NoBatchError, estimate_memory, predict_max_batch_size
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.summary_table import format_table
    from lightning_memkit.units import format_bytes

    rows, results, estimates, shapes = [], [], {}, []
    batch = _named_worst_batch(args, module, datamodule)
    with reusing_fake_copies():  # one fake copy of the module and one worst batch serve every mode and size
        for mode in modes:
            try:
                estimate = estimate_memory(module, args.batch_size, batch=batch, mode=mode, device=args.device,
                                           datamodule=datamodule, gpu=gpu)
                prediction = predict_max_batch_size(module, memory, mode=mode, margin=args.margin, device=args.device,
                                                    batch=batch, datamodule=datamodule, gpu=gpu)
                shapes.append((mode.name, estimate, prediction))
                allocated, reserved, needs = _figures(estimate)
                rows.append((mode.name, estimate.batch_size, format_bytes(allocated), format_bytes(reserved), format_bytes(needs),
                             prediction.batch_size, format_bytes(prediction.predicted_bytes)))
                results.append({"mode": mode.name, "estimate": estimate.to_dict(), "max_batch": prediction.to_dict()})
                estimates[mode.name] = (mode, estimate)
            except (NoBatchError, EstimateError, ValueError) as error:
                if isinstance(error, DoesNotFitError):  # the fix, in this command's syntax
                    error = error.describe(_other_modes_hint(mode.name))
                error = _in_cli_terms(error, args)
                rows.append((mode.name, "-", "-", "-", "-", "-", "-"))
                results.append({"mode": mode.name, "error": str(error)})
                print(f"memkit estimate: mode {mode.name}: {error}", file=sys.stderr)
    print(f"memkit estimate: {args.module} on {_target_words(args, gpu)}, {format_bytes(memory)} device memory, "
          f"{args.margin:.0%} kept free (fake tensors)")
    print(format_table(("mode", "batch", "allocated", "reserved", "device needs", "max batch", "needs at max"), rows))
    for line in _batch_lines(shapes):
        print(line)
    for line in _kernels_and_notes([(r["mode"], r["estimate"]["notes"]) for r in results if "estimate" in r]):
        print(line)
    status = 0 if all("error" not in r for r in results) else 1  # any requested mode that failed fails the command
    if args.check and estimates:
        checks = _check(args, module, estimates)
        for result in results:
            if result["mode"] in checks:
                result["check"] = checks[result["mode"]]
        if any("error" in c for c in checks.values()):
            status = 1
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump({"module": args.module, "device": args.device, "device_memory_bytes": memory, "results": results},
                      file, indent=2, default=str)
    return status


def _in_cli_terms(error: Any, args: argparse.Namespace) -> Any:
    """``error`` as this command says it: a data-dependent estimate failure's advice names memkit trace, which
    measures real steps (the Python advice names measure_training_step()); any other error as it is."""
    from lightning_memkit.estimate.core import DATA_DEPENDENT_ADVICE

    text = str(error)
    if not getattr(error, "data_dependent", False) or DATA_DEPENDENT_ADVICE not in text:
        return error
    given = (("init-args", args.init_args), ("datamodule", args.datamodule), ("datamodule-args", args.datamodule_args))
    same = "".join(f" --{name} '{value}'" for name, value in given if value and value != "{}")
    advice = (f"measure real steps instead: memkit trace {args.module}{same} --batch-size N (a small N; "
              "--accelerator gpu on a GPU), or express it without the data-dependent shape.")
    return text.replace(DATA_DEPENDENT_ADVICE, advice)


def _named_worst_batch(args: argparse.Namespace, module: Any, datamodule: Any) -> Any:
    """With ``--size-of``, the worst batch found from the sizes named (else ``None``: the estimate finds it)."""
    if args.size_of is None:
        return None
    from lightning_memkit.estimate.worst_batch import worst_batch_and_length

    return worst_batch_and_length(module, datamodule, size_of=args.size_of)[0]


def _batch_lines(shapes: list[tuple[str, Any, Any]]) -> list[str]:
    """Which batch each answer used: the shapes estimated and at the max batch, and what they hold for."""
    if not shapes:
        return []
    lines = [f"batch: {shapes[0][1].batch_note}"]
    for mode, estimate, prediction in shapes:
        lines.append(f"  {mode}: estimated on {estimate.batch_shapes}; max batch {prediction.batch_size} on "
                     f"{prediction.batch_shapes}")
    return lines


# ------------------------------------------------------------------------------------------ --check
def _error_percent(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured:+.1%}" if measured else "-"


def _check(args: argparse.Namespace, module: Any, estimates: dict[str, tuple[Any, Any]]) -> dict[str, dict]:
    """Two real training steps per estimated mode on this GPU, printed beside the estimate; returns per-mode results."""
    import gc

    import torch

    from lightning_memkit.summary_table import format_table
    from lightning_memkit.units import format_bytes

    rows, checks = [], {}
    for name, (mode, estimate) in estimates.items():
        try:
            measured = _measure_cuda_steps(module, args, mode, estimate.batch_size)
        except Exception as error:  # noqa: BLE001 - one mode's failure is reported in its row, the others still run
            first_line = (str(error).strip().splitlines() or [""])[0]
            checks[name] = {"error": f"{type(error).__name__}: {first_line}"}
            rows.append((name, estimate.batch_size, format_bytes(estimate.cuda.peak_allocated_bytes), "-", "-",
                         format_bytes(estimate.cuda.peak_reserved_bytes), "-", "-"))
            print(f"memkit estimate --check: mode {name}: {checks[name]['error']}", file=sys.stderr)
            continue
        allocated, reserved = estimate.cuda.peak_allocated_bytes, estimate.cuda.peak_reserved_bytes
        checks[name] = {"estimated_peak_allocated_bytes": allocated, "estimated_peak_reserved_bytes": reserved, **measured}
        rows.append((name, estimate.batch_size,
                     format_bytes(allocated), format_bytes(measured["peak_allocated_bytes"]),
                     _error_percent(allocated, measured["peak_allocated_bytes"]),
                     format_bytes(reserved), format_bytes(measured["peak_reserved_bytes"]),
                     _error_percent(reserved, measured["peak_reserved_bytes"])))
    gc.collect()  # what a failed fit's error held is gone now: give its cached blocks back too
    torch.cuda.empty_cache()
    print(f"\ncheck: two real training steps per mode on {torch.cuda.get_device_name()} (a Trainer on a copy of the module, "
          "peaks from on_train_start)")
    print(format_table(("mode", "batch", "allocated est", "allocated real", "error", "reserved est", "reserved real", "error"), rows))
    return checks


def _measure_cuda_steps(module: Any, args: argparse.Namespace, mode: Any, batch_size: int | None) -> dict[str, int]:
    """Train two real steps of a copy of ``module`` on this GPU in ``mode`` (Lightning's Trainer, as the recorded
    GPU truth was taken) and return ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` over them,
    counted from ``on_train_start`` (model and optimizer on the device, no optimizer state yet), in bytes.

    The module itself is not touched; everything the fit made is freed and the allocator's cache emptied.
    Raises ``ValueError`` when the loader's batch is not ``batch_size`` (the size cannot be set).
    """
    import copy
    import gc
    import logging
    import tempfile

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr

    from lightning_memkit.cli.common import build_instance, json_object, load_object
    from lightning_memkit.estimate.batches import batch_size_of
    from lightning_memkit.modes.checkpointing import CheckpointBudget

    class PeakReader(pl.Callback):
        def __init__(self) -> None:
            self.batch_sizes: list[int | None] = []
            self.peaks: tuple[int, int] | None = None

        def on_train_start(self, trainer, pl_module) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.batch_sizes.append(batch_size_of(batch))

        def on_train_end(self, trainer, pl_module) -> None:
            torch.cuda.synchronize()
            self.peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())

    real = copy.deepcopy(module)
    datamodule = None
    if args.datamodule:
        datamodule = build_instance(load_object(args.datamodule), json_object(args.datamodule_args, "--datamodule-args"),
                                    batch_size=args.batch_size, what="datamodule")
    elif args.batch_size is not None:
        if not lightning_hasattr(real, "batch_size"):
            raise ValueError(f"{type(module).__name__} has no batch_size attribute or hparam to train --batch-size "
                             f"{args.batch_size} with; drop --batch-size or give the size in --init-args")
        lightning_setattr(real, "batch_size", args.batch_size)
    # auto checkpointing needs no measuring forward (the estimate makes none); a budget measures, as in training
    kwargs = mode.trainer_kwargs("cuda", verbose=False, **({} if isinstance(mode.checkpoint, CheckpointBudget) else {"measure": False})) \
        if mode.checkpoint is not None else mode.trainer_kwargs("cuda")
    reader = PeakReader()
    gc.collect()
    torch.cuda.empty_cache()
    quiet = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")]
    levels = [logger.level for logger in quiet]  # the Trainer's banner lines would split the printed tables
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="memkit_check_") as root:
            trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=2, precision=kwargs["precision"], logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
                                 callbacks=[*kwargs["callbacks"], reader])
            trainer.fit(real, datamodule=datamodule)
            del trainer
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
        del real, datamodule
        gc.collect()
        torch.cuda.empty_cache()
    if reader.peaks is None or not reader.batch_sizes:
        raise ValueError("the fit ended before two training steps (is the train dataset empty?)")
    if batch_size is not None and reader.batch_sizes[0] != batch_size:
        raise ValueError(f"the real fit's batch has {reader.batch_sizes[0]} samples, the estimate's {batch_size}: the loader "
                         "does not take its size from a batch_size attribute; give the size in --init-args / --datamodule-args")
    return {"peak_allocated_bytes": reader.peaks[0], "peak_reserved_bytes": reader.peaks[1], "steps": len(reader.batch_sizes)}


# ------------------------------------------------------------------------------------------ N GPUs
def _rank_figures(estimate: Any) -> tuple[int, int | None, int]:
    """(allocated, reserved, device needs) per rank, bytes. On CUDA: the one-process allocator view shifted by the
    rank's tensor difference (its shards and buffers against the one-process step); the per-rank allocator
    itself is not replayed. On CPU: the rank's tensor peak."""
    single = estimate.single
    if single.cuda is None:
        return estimate.peak_bytes, None, estimate.peak_bytes
    shift = estimate.peak_bytes - single.peak_bytes
    allocated = single.cuda.peak_allocated_bytes + shift
    reserved = max(allocated, single.cuda.peak_reserved_bytes + shift)
    return allocated, reserved, reserved + single.cuda.context_bytes + single.cuda.workspace_bytes


def _fully_sharded(strategy: str) -> bool:
    from lightning_memkit.estimate.distributed import sharding_of

    sharding = sharding_of(strategy, 1)
    return sharding.parameters and sharding.gradients and sharding.optimizer_state


def _run_distributed(args, module, datamodule, modes, strategies, memory, gpu, wrap) -> int:
    from lightning_memkit.estimate import EstimateError, NoBatchError
    from lightning_memkit.estimate.core import reusing_fake_copies
    from lightning_memkit.estimate.distributed import estimate_distributed_memory
    from lightning_memkit.summary_table import format_table
    from lightning_memkit.units import format_bytes

    usable = (1 - args.margin) * memory
    sizes = world_sizes_tried(args.max_world_size)
    rows, results, notes_by_mode = [], [], []
    with reusing_fake_copies():  # one fake step per mode serves every strategy and world size
        for strategy in strategies:
            for mode in modes:
                def per_rank(world_size: int):
                    estimate = estimate_distributed_memory(module, args.batch_size, strategy=strategy, world_size=world_size,
                                                           wrap=wrap, mode=mode, device=args.device, datamodule=datamodule,
                                                           gpu=gpu)
                    return estimate, _rank_figures(estimate)

                try:
                    estimate, (allocated, reserved, needs) = per_rank(args.world_size)
                    needs_by_size = {}
                    minimum = None
                    for size in sizes:
                        needs_by_size[size] = per_rank(size)[1][2]
                        if needs_by_size[size] <= usable:
                            minimum = size
                            break
                except (NoBatchError, EstimateError, ValueError) as error:
                    error = _in_cli_terms(error, args)
                    rows.append((strategy, mode.name, args.world_size, "-", "-", "-", "-", "-", "-"))
                    results.append({"strategy": strategy, "mode": mode.name, "error": str(error)})
                    print(f"memkit estimate: {strategy}, mode {mode.name}: {error}", file=sys.stderr)
                    continue
                rows.append((strategy, mode.name, args.world_size, estimate.single.batch_size, format_bytes(allocated),
                             format_bytes(reserved), format_bytes(needs), "yes" if needs <= usable else "no",
                             minimum if minimum is not None else f"none <= {args.max_world_size}"))
                results.append({"strategy": strategy, "mode": mode.name, "world_size": args.world_size,
                                "batch_size_per_rank": estimate.single.batch_size,
                                "per_rank": {"allocated_bytes": allocated, "reserved_bytes": reserved, "device_bytes": needs},
                                "fits": needs <= usable, "min_world_size": minimum,
                                "device_bytes_by_world_size": needs_by_size, "estimate": estimate.to_dict()})
                notes_by_mode.append((mode.name, estimate.notes))
    batch_words = f"batch {args.batch_size} per rank" if args.batch_size is not None else "the module's batch per rank"
    print(f"memkit estimate: {args.module} per rank on {args.world_size} ranks, {batch_words}, {_target_words(args, gpu)}, "
          f"{format_bytes(memory)} device memory, {args.margin:.0%} kept free (fake tensors)")
    print(format_table(("strategy", "mode", "ranks", "batch/rank", "allocated/rank", "reserved/rank", "device needs/rank",
                        "fits", "min GPUs"), rows, left_columns=2))
    done = [r for r in results if "error" not in r]
    if done:
        tried = ", ".join(str(s) for s in sizes)
        print(f"min GPUs: the fewest of {tried} GPUs on which one rank's device needs fit {format_bytes(usable)} "
              f"({1 - args.margin:.0%} of {format_bytes(memory)}) at {batch_words}:")
        for result in done:
            size = result["min_world_size"]
            if size is not None:
                print(f"  {result['strategy']} {result['mode']}: {size}")
            else:
                needs = result["device_bytes_by_world_size"][sizes[-1]]
                print(f"  {result['strategy']} {result['mode']}: none fits on up to {sizes[-1]} GPUs: one rank still needs "
                      f"{format_bytes(needs)} on {sizes[-1]} (what {result['strategy']} does not divide: activations, "
                      f"{'unsharded model states, ' if not _fully_sharded(result['strategy']) else ''}workspaces, the CUDA "
                      "context); try --modes checkpoint or --modes bf16, a smaller --batch-size, more memory per GPU"
                      f"{', or a sharding --strategy (fsdp)' if not _fully_sharded(result['strategy']) else ''}")
    lines = _kernels_and_notes(notes_by_mode)
    if args.device == "cuda" and done:
        lines.append("note: per rank, allocated and reserved are the one-process allocator view shifted by the rank's shards "
                     "and buffers (the per-rank allocator is not replayed)")
    for line in lines:
        print(line)
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump({"module": args.module, "device": args.device, "device_memory_bytes": memory,
                       "world_size": args.world_size, "world_sizes_tried": sizes, "results": results},
                      file, indent=2, default=str)
    return 0 if len(done) == len(results) else 1  # any requested strategy and mode that failed fails the command
