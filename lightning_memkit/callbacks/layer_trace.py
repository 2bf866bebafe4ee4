"""LayerTrace: a per-module memory table, figure and category split of chosen training steps.

Thin wiring of :class:`~lightning_memkit.trace.tracer.LayerTracer` to Lightning: which steps, which
hooks, which loggers and files. Measuring is the tracer's job.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import torch.nn as nn
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import forget_model_logging, logging_step, optimizer_steps_after_batch
from lightning_memkit.callbacks import _checks as checks
from lightning_memkit.callbacks._files import run_files_dir
from lightning_memkit.compiled import COMPILED_CHOICES
from lightning_memkit.tensorboard.dashboard import markdown_code, register_dashboard
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX
from lightning_memkit.trace.trace_records import LayerTraceResult, trace_filename, write_new_file
from lightning_memkit.trace.tracer import LayerTracer
from lightning_memkit.units import format_bytes

__all__ = ["LayerTrace"]

#: the trace's scalars (after ``<prefix>/``) that loggers other than TensorBoard get: a few columns in a
#: metrics.csv, not one per category and moment (TensorBoard and the JSON file have every category)
COMPACT_METRICS = (
    "trace/peak_MiB",
    "trace/end_MiB",
    "trace/peak/parameters_MiB",
    "trace/peak/gradients_MiB",
    "trace/peak/optimizer_state_MiB",
    "trace/peak/activations_MiB",
)

#: the accepted form of LayerTrace's ``modules`` (also in docs/arguments.md)
MODULES_ACCEPTED = (
    "an fnmatch pattern of module names ('encoder.layers.*'), an nn.Module subclass, a class path "
    "('torch.nn.Linear'), a list of them, or None"
)


class LayerTrace(Callback):
    r"""Trace chosen training steps module by module: where memory goes, and what it is.

    Usage::

        from lightning_memkit import LayerTrace
        trainer = Trainer(callbacks=[LayerTrace()])      # traces step 1 by default
        trainer.fit(model)                               # tensorboard --logdir lightning_logs

    A traced step covers the whole training step, ``on_train_batch_start`` to
    ``on_train_batch_end``: forward, backward and the optimizer step (with gradient
    accumulation, every micro-batch up to the optimizer step). Its hooks and modes are removed
    afterwards, so other steps run at full speed. Under DDP, FSDP and ``ModelParallelStrategy`` (FSDP2)
    each rank traces its own step (its own shards); no collective is used. Module names and classes are
    the user's: the segments torch's wrappers add (FSDP1's ``_fsdp_wrapped_module``, ``checkpoint_wrapper``'s
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``) are dropped, a wrapped module is
    traced once, and FSDP2's ``FSDPBlock`` is shown as ``Block``.

    After each traced step, global rank zero prints (Lightning's info log, as Lightning's own
    callbacks do; ``verbose=False`` turns it off) the bytes per category and where the module
    table, the figure and the JSON file went. A step in ``at_steps`` that the run never reached
    (it had fewer steps) is named in one warning at fit end. Kept after the fit, the callback
    holds only records (:attr:`results`, :attr:`paths`), never the model's tensors.

    What is written, for a traced step ``N`` (``prefix`` = ``"memory"``):

    ===========================================  =====  =============================================
    where                                        unit   what
    ===========================================  =====  =============================================
    TensorBoard text ``memory/trace/table``      MiB    the indented module table (``add_text``)
    TensorBoard text ``memory/trace/categories`` MiB    bytes per category at the peak and the end
    TensorBoard image ``memory/trace/figure``    MiB    live memory against event index (``add_figure``)
    ``memory/trace/peak_MiB``, ``end_MiB``       MiB    the step's peak / end live tensor bytes
    ``memory/trace/peak/<category>_MiB``         MiB    each category at the peak (TensorBoard)
    ``memory/trace/end/<category>_MiB``          MiB    each category at step end (TensorBoard)
    ``<dir>/memkit_trace_step{N}.json``          bytes  the raw events (``_rank{r}`` added on rank r > 0)
    ===========================================  =====  =============================================

    Loggers other than TensorBoard (a CSVLogger's metrics.csv) get six columns only: ``peak_MiB``,
    ``end_MiB`` and the peak's parameters, gradients, optimizer_state and activations
    (:data:`COMPACT_METRICS`); every category is in the JSON file.

    ``<dir>`` is ``dirpath`` when given, else the first logger's ``log_dir``; without a logger
    and without ``dirpath`` no file is written (nothing lands in the working directory unasked;
    the results stay on :attr:`results`), the rule MemoryTracker's records follow too. A file of
    that name already there (another run's) is never overwritten: the new one gets the first free
    ``-v1``, ``-v2``, ... suffix (``memkit_trace_step1-v1.json``), as Lightning's ModelCheckpoint does.

    Categories: parameters, buffers, gradients, optimizer_state, autocast_weight_copies,
    activations (saved for backward), inputs, temporaries, other; on CUDA also
    ``reserved_minus_allocated`` and ``nvml_unseen`` (see docs/layer_trace.md).

    Args:
        at_steps: the steps to trace (Lightning's logging step: optimizer steps so far). Default
            ``(1,)`` when ``every_n_steps`` is not given: step 1 is after warm-up, so Adam's lazily
            created state is included.
        every_n_steps: also trace every n-th step (``n, 2n, ...``).
        max_depth: trace modules at most this deep (root 0); ``None`` traces all.
        modules: only trace these modules: qualified-name ``fnmatch`` patterns (``"encoder.layers.*"``),
            ``nn.Module`` classes, or class paths naming one (``"torch.nn.Linear"``: a dotted string whose
            last part starts with an upper-case letter is imported, as from a YAML config).
        prefix: the first part of every logged key.
        figure: log the figure (needs matplotlib) to TensorBoard loggers.
        verbose: after each traced step, print (Lightning's info log, global rank zero) the bytes
            per category and where the table, figure and JSON went; ``False``: print nothing.
        max_results: traced results kept in :attr:`results` (oldest dropped).
        dirpath: the directory for the JSON files; default: the first logger's ``log_dir``, and no
            file without a logger (``logger=False``, or ``fast_dev_run``, which switches the loggers off).
        compiled: what to do when the model (or a submodule, or its ``training_step``) is ``torch.compile``d.
            ``"keep"`` (default): the traced step runs compiled; rows for the modules outside compiled code and
            one per compiled region (its bytes and what its graph saved for backward, from the CPU allocator's
            events), no category split inside compiled code; the table says so. ``"eager"``: the traced step
            runs eagerly, traced module by module (the eager program's bytes). See docs/compile.md.

    Attributes:
        results: the :class:`~lightning_memkit.trace.trace_records.LayerTraceResult` of each traced step.
        paths: the JSON files written.
        last_step: the last training step (logging step) the latest fit started; ``None`` before one.
    """

    #: ActivationCheckpointing moves itself ahead of callbacks that open a step window.
    memkit_opens_step_window = True
    #: the TensorBoard dashboard adds the layer-trace charts for a callback with this marker.
    memkit_layer_trace = True

    def __init__(
        self,
        at_steps: int | str | Sequence[int | str] | None = None,
        every_n_steps: int | None = None,
        max_depth: int | None = None,
        modules: str | type[nn.Module] | Sequence[str | type[nn.Module]] | None = None,
        prefix: str = DEFAULT_PREFIX,
        figure: bool = True,
        verbose: bool = True,
        max_results: int = 16,
        dirpath: str | os.PathLike | None = None,
        compiled: Literal["keep", "eager"] = "keep",
    ) -> None:
        owner = "LayerTrace"
        self.compiled = checks.choice(
            owner,
            "compiled",
            compiled,
            COMPILED_CHOICES,
            "'keep' (trace the compiled step as it runs) or 'eager' (run the traced step eagerly, module by module)",
        )
        self.every_n_steps = checks.integer(
            owner,
            "every_n_steps",
            every_n_steps,
            1,
            "a positive integer, or None to trace only at_steps",
            optional=True,
        )
        if at_steps is None:
            at_steps = (1,) if every_n_steps is None else ()
        self.at_steps = checks.steps(
            owner, "at_steps", at_steps, "a step (an int >= 0, or a str holding one) or a list of them, e.g. [1, 100]"
        )
        self.max_depth = checks.integer(owner, "max_depth", max_depth, 0, "None or an integer >= 0", optional=True)
        self.modules = checks.module_filters(owner, "modules", modules, MODULES_ACCEPTED)
        self.prefix = checks.text(owner, "prefix", prefix, "a non-empty str, e.g. 'memory'")
        self.figure = checks.boolean(owner, "figure", figure)
        self.verbose = checks.boolean(owner, "verbose", verbose)
        self.max_results = checks.integer(owner, "max_results", max_results, 1, "an integer >= 1 (results kept)")
        self.dirpath = checks.path(
            owner, "dirpath", dirpath, "a directory path (str), or None for the logger's log dir"
        )
        self.results: list[LayerTraceResult] = []
        self.paths: list[str] = []
        self._tracer: LayerTracer | None = None
        self._traced_steps: set[int] = set()
        self._first_step: int | None = None  # this run's first training step (logging step)
        self.last_step: int | None = None

    def should_trace(self, step: int) -> bool:
        """Whether training step ``step`` is one to trace."""
        if step in self.at_steps:
            return True
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        register_dashboard(trainer)  # memkit's TensorBoard dashboard, once per run
        if trainer.global_step == 0:  # a new run (the same callback given to a second Trainer) traces its steps again
            self._traced_steps.clear()
        self._first_step = self.last_step = None

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        message = self._unreached_message()
        if message:
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ the traced step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._tracer is not None:
            return  # accumulating: the traced window stays open until the optimizer steps
        step = logging_step(trainer)
        if self._first_step is None:
            self._first_step = step
        self.last_step = step
        if step in self._traced_steps or not self.should_trace(step):
            return
        self._traced_steps.add(step)
        try:
            tracer = LayerTracer(
                pl_module,
                trainer.optimizers,
                max_depth=self.max_depth,
                modules=self.modules,
                step=step,
                rank=trainer.global_rank,
                compiled=self.compiled,
            )
            tracer.start(inputs=batch)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"LayerTrace: {error}") from error
        self._tracer = tracer

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._tracer is None or not optimizer_steps_after_batch(trainer):
            return
        tracer, self._tracer = self._tracer, None
        result = tracer.stop()
        self.results.append(result)
        del self.results[: -self.max_results]
        self._publish(trainer, result)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._tracer is not None:  # never leave hooks or modes behind after a failure
            tracer, self._tracer = self._tracer, None
            tracer.stop()
        forget_model_logging(self)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            tracer.stop()
        forget_model_logging(self)

    def _unreached_message(self) -> str | None:
        """The fit-end warning for ``at_steps`` (or ``every_n_steps``) this run never traced, or None."""
        missing = sorted(s for s in self.at_steps if s not in self._traced_steps)
        never_by_every = self.every_n_steps is not None and not self._traced_steps and not self.at_steps
        if not missing and not never_by_every:
            return None
        first, last = self._first_step, self.last_step

        def steps(values: list[int]) -> str:
            return f"step{'s' if len(values) > 1 else ''} {', '.join(map(str, values))}"

        if last is None:
            ran = "no training step ran in this fit"
            fix = "check that the Trainer trains (max_steps, limit_train_batches, the train dataloader's length)"
            after, before, inside = missing, [], []
        else:
            ran = f"the run's last training step was {last} (steps count optimizer steps from 0" + (
                f"; this run resumed at step {first})" if first else ")"
            )
            fix = (
                f"give steps the run reaches, e.g. LayerTrace(at_steps=({last},)), or train longer "
                "(max_steps / max_epochs / more batches per epoch)"
            )
            after = [s for s in missing if s > last]
            before = [s for s in missing if first is not None and s < first]
            inside = [s for s in missing if s not in after and s not in before]
        problems = []
        if after:
            problems.append(f"{steps(after)} of at_steps never reached")
        if before:
            problems.append(f"{steps(before)} of at_steps came before this run's first step {first}")
        if inside:  # inside the run but untraced: the fit ended inside that step's gradient accumulation
            problems.append(f"{steps(inside)} not traced (the fit ended before that step's optimizer step)")
        if never_by_every:
            problems.append(f"every_n_steps={self.every_n_steps} traced no step")
        if before and not after and not inside and not never_by_every:
            # a resumed fit: training longer cannot reach a step before the checkpoint
            fix = (
                f"give a step this resumed run reaches, from {first} to {last}, e.g. LayerTrace(at_steps=({first},)); "
                "the steps before the checkpoint belong to the run that wrote it (its trace files, if it traced them)"
            )
        elif before:
            fix += f"; steps before {first} belong to the run that wrote the checkpoint"
        return (
            f"memkit LayerTrace: {'; '.join(problems)}: {ran}. "
            f"Nothing was traced for {'them' if len(missing) > 1 else 'it'}; to trace, {fix}."
        )

    # ------------------------------------------------------------------ sinks
    def _publish(self, trainer: Trainer, result: LayerTraceResult) -> None:
        if result.errors:
            rank_zero_warn(
                f"memkit LayerTrace: step {result.step} traced with problems: {'; '.join(result.errors[:3])}"
            )
        if not result.module_events("forward"):
            # e.g. a training_step that returns None before calling the model (a skipped batch): the table would
            # show the step markers alone, which reads like a step that used no memory
            rank_zero_warn(
                f"memkit LayerTrace: step {result.step} ran no module's forward (training_step returned before "
                "calling the model, e.g. a skipped batch that returns None; or the model runs without module "
                "hooks, e.g. TorchScript): its trace holds the step markers only; trace another step "
                "(at_steps=..., or `memkit trace --step N`)"
            )
        step = result.step if result.step is not None else 0
        metrics = result.metrics(self.prefix)
        compact = {name: value for name, value in metrics.items() if name[len(self.prefix) + 1 :] in COMPACT_METRICS}
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):  # every category (memkit's dashboard charts them)
                logger.log_metrics(metrics, step=step)
                self._to_tensorboard(logger, result, step)
            else:  # a table's columns (metrics.csv): the compact set; every category is in the JSON file
                logger.log_metrics(compact, step=step)
        directory = self.dirpath if self.dirpath is not None else run_files_dir(trainer)
        path = None
        if directory is not None:
            try:
                path = write_new_file(directory, trace_filename(result.step, result.rank), result.to_json())
                self.paths.append(path)
            except OSError as error:
                rank_zero_warn(
                    "memkit LayerTrace: could not write "
                    f"{trace_filename(result.step, result.rank)} in {directory}: {error}"
                )
        if self.verbose:
            rank_zero_info(self._summary(trainer, result, path))

    def _summary(self, trainer: Trainer, result: LayerTraceResult, path: str | None) -> str:
        """What ``verbose`` prints after a traced step: the category table and where everything went."""
        lines = [
            f"memkit LayerTrace: step {result.step} on {result.device}: peak {format_bytes(result.peak_bytes)}, "
            f"end {format_bytes(result.end_bytes)}; bytes by category:",
            result.format_categories(),
        ]
        lines.extend(f"note: {note}" for note in result.notes)
        board = next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)
        if board is not None:
            lines.append(
                f"module table and figure: TensorBoard (tensorboard --logdir {board.log_dir}), "
                f"text {self.prefix}/trace/table and image {self.prefix}/trace/figure"
            )
        else:
            lines.append(
                "module table (no TensorBoardLogger to log it to): this LayerTrace's .results[-1].format_table()"
                + (f", or `memkit report {os.path.dirname(path)}`" if path is not None else "")
            )
        if path is not None:
            lines.append(f"raw events: {path}")
        else:
            lines.append(
                "raw events: no file without a logger; LayerTrace(dirpath=...) writes them, "
                "or .results[-1].to_json(path)"
            )
        return "\n".join(lines)

    def _to_tensorboard(self, logger: TensorBoardLogger, result: LayerTraceResult, step: int) -> None:
        experiment = logger.experiment
        # TensorBoard's text tab renders Markdown: indent by 4 spaces to keep the columns
        experiment.add_text(f"{self.prefix}/trace/table", markdown_code(result.format_table()), global_step=step)
        experiment.add_text(
            f"{self.prefix}/trace/categories", markdown_code(result.format_categories()), global_step=step
        )
        if self.figure:
            try:
                experiment.add_figure(f"{self.prefix}/trace/figure", result.figure(), global_step=step, close=True)
            except ImportError as error:
                rank_zero_warn(f"memkit LayerTrace: no figure ({error}); install matplotlib or pass figure=False")
                self.figure = False
        experiment.flush()
