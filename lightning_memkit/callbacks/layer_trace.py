"""LayerTrace: a per-module memory table, figure and category split of chosen training steps.

Thin wiring of :class:`~lightning_memkit.trace.LayerTracer` to Lightning: which steps, which
hooks, which loggers and files. Measuring is the tracer's job.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_memkit._lightning_compat import log_dir, logging_step, optimizer_steps_after_batch
from lightning_memkit.tensorboard.dashboard import markdown_code
from lightning_memkit.tensorboard.tags import DEFAULT_PREFIX
from lightning_memkit.trace.records import LayerTraceResult, trace_filename
from lightning_memkit.trace.tracer import LayerTracer

__all__ = ["LayerTrace"]


class LayerTrace(Callback):
    r"""Trace chosen training steps module by module: where memory goes, and what it is.

    Usage::

        from lightning_memkit import LayerTrace
        trainer = Trainer(callbacks=[LayerTrace()])      # traces step 1 by default
        trainer.fit(model)                               # tensorboard --logdir lightning_logs

    A traced step covers the whole training step, ``on_train_batch_start`` to
    ``on_train_batch_end``: forward, backward and the optimizer step (with gradient
    accumulation, every micro-batch up to the optimizer step). Its hooks and modes are removed
    afterwards, so other steps run at full speed. Under DDP each rank traces its own step; no
    collective is used.

    What is written, for a traced step ``N`` (``prefix`` = ``"memory"``):

    ===========================================  =====  =============================================
    where                                        unit   what
    ===========================================  =====  =============================================
    TensorBoard text ``memory/trace/table``      MiB    the indented module table (``add_text``)
    TensorBoard text ``memory/trace/categories`` MiB    bytes per category at the peak and the end
    TensorBoard image ``memory/trace/figure``    MiB    live memory against event index (``add_figure``)
    ``memory/trace/peak_MiB``, ``end_MiB``       MiB    the step's peak / end live tensor bytes
    ``memory/trace/peak/<category>_MiB``         MiB    each category at the peak (every logger)
    ``memory/trace/end/<category>_MiB``          MiB    each category at step end (every logger)
    ``<log_dir>/memkit_trace_step{N}.json``      bytes  the raw events (``_rank{r}`` added on rank r > 0)
    ===========================================  =====  =============================================

    Categories: parameters, buffers, gradients, optimizer_state, autocast_weight_copies,
    activations (saved for backward), inputs, temporaries, other; on CUDA also
    ``reserved_minus_allocated`` and ``nvml_unseen`` (see docs/layer_trace.md).

    Args:
        at_steps: the steps to trace (Lightning's logging step: optimizer steps so far). Default
            ``(1,)`` when ``every_n_steps`` is not given: step 1 is after warm-up, so Adam's lazily
            created state is included.
        every_n_steps: also trace every n-th step (``n, 2n, ...``).
        max_depth: trace modules at most this deep (root 0); ``None`` traces all.
        modules: only trace these modules: qualified-name ``fnmatch`` patterns or classes.
        prefix: the first part of every logged key.
        figure: log the figure (needs matplotlib) to TensorBoard loggers.
        verbose: print the table and the category split (rank zero only) after a traced step.
        max_results: traced results kept in :attr:`results` (oldest dropped).

    Attributes:
        results: the :class:`~lightning_memkit.trace.LayerTraceResult` of each traced step.
        paths: the JSON files written.
    """

    #: ActivationCheckpointing moves itself ahead of callbacks that open a step window.
    memkit_opens_step_window = True
    #: the TensorBoard dashboard adds the layer-trace charts for a callback with this marker.
    memkit_layer_trace = True

    def __init__(
        self,
        at_steps: Iterable[int] | None = None,
        every_n_steps: int | None = None,
        max_depth: int | None = None,
        modules: Iterable[str | type] | str | type | None = None,
        prefix: str = DEFAULT_PREFIX,
        figure: bool = True,
        verbose: bool = False,
        max_results: int = 16,
    ) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1):
            raise MisconfigurationException(f"LayerTrace(every_n_steps={every_n_steps!r}): give a positive integer, or None to trace only at_steps")
        if at_steps is None:
            at_steps = (1,) if every_n_steps is None else ()
        try:
            steps = {int(s) for s in at_steps}
        except (TypeError, ValueError):
            raise MisconfigurationException(f"LayerTrace(at_steps={at_steps!r}): give step numbers, e.g. (1, 100)") from None
        if any(s < 0 for s in steps):
            raise MisconfigurationException(f"LayerTrace(at_steps={sorted(steps)}): steps are counted from 0; give non-negative integers")
        if max_depth is not None and (not isinstance(max_depth, int) or max_depth < 0):
            raise MisconfigurationException(f"LayerTrace(max_depth={max_depth!r}): give None or an integer >= 0")
        self.at_steps = frozenset(steps)
        self.every_n_steps = every_n_steps
        self.max_depth = max_depth
        self.modules = modules
        self.prefix = prefix
        self.figure = figure
        self.verbose = verbose
        self.max_results = max_results
        self.results: list[LayerTraceResult] = []
        self.paths: list[str] = []
        self._tracer: LayerTracer | None = None
        self._traced_steps: set[int] = set()

    def should_trace(self, step: int) -> bool:
        """Whether training step ``step`` is one to trace."""
        if step in self.at_steps:
            return True
        return self.every_n_steps is not None and step > 0 and step % self.every_n_steps == 0

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_memkit.tensorboard.dashboard import register_dashboard  # memkit's TensorBoard dashboard, once per run

        register_dashboard(trainer)
        if trainer.global_step == 0:  # a new run (the same callback given to a second Trainer) traces its steps again
            self._traced_steps.clear()

    # ------------------------------------------------------------------ the traced step
    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._tracer is not None:
            return  # accumulating: the traced window stays open until the optimizer steps
        step = logging_step(trainer)
        if step in self._traced_steps or not self.should_trace(step):
            return
        self._traced_steps.add(step)
        try:
            tracer = LayerTracer(pl_module, trainer.optimizers, max_depth=self.max_depth, modules=self.modules,
                                 step=step, rank=trainer.global_rank)
            tracer.start(inputs=batch)
        except (TypeError, ValueError) as error:
            raise MisconfigurationException(f"LayerTrace: {error}") from error
        self._tracer = tracer

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
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

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            tracer.stop()

    # ------------------------------------------------------------------ sinks
    def _publish(self, trainer: Trainer, result: LayerTraceResult) -> None:
        if result.errors:
            rank_zero_warn(f"memkit LayerTrace: step {result.step} traced with problems: {'; '.join(result.errors[:3])}")
        step = result.step if result.step is not None else 0
        for logger in trainer.loggers:
            logger.log_metrics(result.metrics(self.prefix), step=step)
            if isinstance(logger, TensorBoardLogger):
                self._to_tensorboard(logger, result, step)
        directory = log_dir(trainer)
        path = os.path.join(directory, trace_filename(result.step, result.rank))
        try:
            result.to_json(path)
            self.paths.append(path)
        except OSError as error:
            rank_zero_warn(f"memkit LayerTrace: could not write {path}: {error}")
        if self.verbose and trainer.is_global_zero:
            print(result.format_table())
            print(result.format_categories())

    def _to_tensorboard(self, logger: TensorBoardLogger, result: LayerTraceResult, step: int) -> None:
        experiment = logger.experiment
        # TensorBoard's text tab renders Markdown: indent by 4 spaces to keep the columns
        experiment.add_text(f"{self.prefix}/trace/table", markdown_code(result.format_table()), global_step=step)
        experiment.add_text(f"{self.prefix}/trace/categories", markdown_code(result.format_categories()), global_step=step)
        if self.figure:
            try:
                experiment.add_figure(f"{self.prefix}/trace/figure", result.figure(), global_step=step, close=True)
            except ImportError as error:
                rank_zero_warn(f"memkit LayerTrace: no figure ({error}); install matplotlib or pass figure=False")
                self.figure = False
        experiment.flush()

