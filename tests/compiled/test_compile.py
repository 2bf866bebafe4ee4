"""memkit with torch.compile: measuring never switches compile off, and checkpointing works compiled.

Models (tests/helpers/compile_models.py) use ``backend="aot_eager"`` through a counting backend: each step's compiled
graph calls are counted, so "compiled on every step" is read, not assumed.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
import torch

from lightning_memkit import ActivationCheckpointing
from tests.helpers.compile_models import CompiledCNN, CompiledGPT2, CountingBackend, GraphCallsPerStep
from tests.helpers.trainers import make_trainer


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    gc.collect()  # garbage of an earlier test would count in a whole-process reading
    yield
    torch._dynamo.reset()


def _fit(model, tmp_path, callbacks=(), steps=3, **kwargs):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, max_steps=steps, callbacks=list(callbacks), **kwargs)
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize("make", [CompiledGPT2, CompiledCNN], ids=["gpt2", "cnn"])
def test_checkpointing_a_compiled_model_trains_compiled_with_the_uncompiled_losses(tmp_path, make):
    backend = CountingBackend()
    torch.manual_seed(0)
    compiled = make(backend=backend)
    torch.manual_seed(0)
    eager = make(compile=False)
    counts = GraphCallsPerStep(backend)
    checkpointing = ActivationCheckpointing("auto", verbose=False)
    _fit(compiled, tmp_path / "compiled", [checkpointing, counts])
    _fit(eager, tmp_path / "eager", [ActivationCheckpointing("auto", verbose=False)])
    assert checkpointing.plan is not None and checkpointing.plan.count >= 1
    assert backend.compiled >= 1 and all(calls >= 1 for calls in counts.per_step), counts.per_step
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(eager.losses), rtol=1e-5, atol=1e-6)
    for (name, a), (_, b) in zip(compiled.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)  # BatchNorm statistics updated once, as eager


class _ProfiledSteps(pl.Callback):
    """The tests' own reading of each training step's peak: the bytes of every live CPU tensor storage at the
    batch's start (a walk of the collector's objects, plus the gradients) plus the highest running sum of the
    allocator's ``[memory]`` events that the public ``torch.profiler.profile(...).events()`` lists."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._profile = None
        self._base = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from tests.helpers.live_tensors import storage_bytes

        # no gc.collect() first: garbage in reference cycles holds its memory until the collector runs, in this
        # run as in the tracker's
        tensors = []
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and type(obj).__name__ != "FakeTensor":
                    tensors.append(obj)
            except ReferenceError:  # a dead weakref proxy
                continue
        self._base = storage_bytes(tensors + [p.grad for p in pl_module.parameters() if p.grad is not None])
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._profile.__exit__(None, None, None)
        # the allocator's events as kineto recorded them (profile.events() folds most into their ops)
        memory = sorted(
            (e.start_ns(), e.nbytes()) for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        running = highest = 0
        for _, nbytes in memory:
            running += nbytes
            highest = max(highest, running)
        self.peaks.append(self._base + highest)
        self._profile = None


@pytest.mark.parametrize("make", [CompiledGPT2, CompiledCNN], ids=["CompiledGPT2", "CompiledCNN"])
def test_tracker_keeps_the_model_compiled_and_reads_the_compiled_steps_peak(tmp_path, make, rerun_in_own_process):
    # Both readings count every live tensor of the process. After the rest of the suite, the process holds tensors
    # that earlier tests left to torch's and the libraries' caches (on GPT-2, 62 KB seen by the tracker's reading and
    # not by this test's gc walk), so the comparison runs in a fresh process of its own.
    if rerun_in_own_process():
        return
    from lightning_memkit import MemoryTracker

    gc.collect()  # both fits below start from a collected process
    backend = CountingBackend()
    torch.manual_seed(0)
    model = make(backend=backend)
    counts = GraphCallsPerStep(backend)
    tracker = MemoryTracker(tensor_peak_every_n_steps=1, verbose=False)
    _fit(model, tmp_path / "tracked", [tracker, counts], steps=4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert len(counts.per_step) == 4 and min(counts.per_step) >= 1, counts.per_step  # compiled graphs ran at every step
    assert tracker.summary.extra["compiled"]["parts"] == [
        next(n for n, m in model.named_children() if isinstance(m, torch._dynamo.eval_frame.OptimizedModule))
    ]
    peaks = [r.peak_tensor_bytes for r in tracker.history]
    assert None not in peaks

    del model, backend, counts  # the profiled run below counts every live tensor of the process, as the tracker did
    torch._dynamo.reset()
    gc.collect()
    torch.manual_seed(0)
    again = make(backend=CountingBackend())
    profiled = _ProfiledSteps()
    _fit(again, tmp_path / "profiled", [profiled], steps=4)
    for step, (mine, theirs) in enumerate(zip(peaks, profiled.peaks, strict=True)):
        assert abs(mine - theirs) <= 0.01 * theirs, (step, mine, theirs)


def test_compile_compat_pins_the_torch_internals():
    """The torch internals lightning_memkit.compiled._torch_compat reads, checked against the real thing."""
    from lightning_memkit.compiled import _torch_compat as compat
    from lightning_memkit.compiled import compiled_parts

    assert compat.OPTIMIZED_MODULE is torch._dynamo.eval_frame.OptimizedModule
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    wrapped = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2), backend="eager"), torch.nn.Linear(2, 2))
    in_place = torch.nn.Sequential(torch.nn.Linear(2, 2))
    in_place[0].compile(backend="eager")
    assert compiled_parts(plain) == [] and compiled_parts(wrapped) == ["0"] and compiled_parts(in_place) == ["0"]
    assert compat.compiled_call_impl(in_place[0]) is not None and compat.compiled_call_impl(plain[0]) is None
    assert compat.compiled_function(torch.compile(lambda x: x + 1, backend="eager"))

    seen = []

    @torch.compile(backend="eager")
    def traced(x):
        seen.append(compat.is_compiling())
        return x * 2

    traced(torch.ones(2))
    assert seen == [True] and not compat.is_compiling()

    # a compiled frame first called under a dispatch mode inside force_eager() still compiles afterwards
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    backend = CountingBackend("eager")
    doubled = torch.compile(lambda x: x * 3, backend=backend)
    with compat.force_eager(), Passthrough():
        doubled(torch.ones(2))
    assert backend.compiled == 0
    doubled(torch.ones(2))
    assert backend.compiled == 1 and backend.calls == 1
    assert compat.dynamo_counters()["stats"]["unique_graphs"] >= 1

    # the allocator's events: a 4000-byte tensor allocated then freed
    assert not compat.profiler_active()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        assert compat.profiler_active()
        block = torch.empty(1000, dtype=torch.float32)
        del block
    events = [nbytes for _, nbytes in compat.allocator_events(profile, "cpu")]
    assert 4000 in events and -4000 in events and events.index(4000) < events.index(-4000)

    # a block allocated while nothing recorded: its free is reported once sizes are tracked
    assert compat.track_cpu_allocation_sizes()
    older = torch.empty(3000, dtype=torch.uint8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        del older
    assert -3000 in [nbytes for _, nbytes in compat.allocator_events(profile, "cpu")]


@pytest.mark.parametrize("make", [CompiledGPT2, CompiledCNN], ids=["gpt2", "cnn"])
def test_doctor_finds_a_kept_graph_on_a_compiled_model_without_switching_compile_off(tmp_path, make):
    from lightning_memkit import MemoryDoctor

    backend = CountingBackend()
    torch.manual_seed(0)
    model = make(backend=backend, leak=True)
    counts = GraphCallsPerStep(backend)
    doctor = MemoryDoctor(window=3, warmup_steps=1, verbose=False)
    _fit(model, tmp_path, [doctor, counts], steps=6)
    assert min(counts.per_step) >= 1, counts.per_step  # compiled graphs ran at every step
    report = doctor.report
    assert report.leak is not None and "compiled model" in report.compiled, report.format()
    # what one step keeps: its loss and logits (backward freed what their graph saved), bytes read off the tensors
    kept = sum(tensor.untyped_storage().nbytes() for tensor in model.kept[-1])
    assert report.leak.bytes_per_step == kept, report.format()
    assert report.leak.growing and report.leak.growing[0].op.startswith("found between steps ("), report.leak.format()
    assert sum(group.bytes_per_step for group in report.leak.growing) == kept


@pytest.mark.parametrize("make", [CompiledGPT2, CompiledCNN], ids=["gpt2", "cnn"])
def test_layer_trace_of_a_compiled_model_runs_compiled_with_rows_only_where_real(tmp_path, make):
    from lightning_memkit import LayerTrace

    backend = CountingBackend()
    torch.manual_seed(0)
    model = make(backend=backend)
    counts = GraphCallsPerStep(backend)
    trace = LayerTrace(at_steps=(1,), verbose=False, figure=False)
    _fit(model, tmp_path, [trace, counts], steps=2)
    assert min(counts.per_step) >= 1, counts.per_step  # the traced step 1 ran compiled graphs too
    result = trace.results[0]
    region = next(n for n, m in model.named_children() if isinstance(m, torch._dynamo.eval_frame.OptimizedModule))
    modules = {e.module for e in result.module_events()}
    assert modules == {
        region
    }  # the compiled region only: nothing inside compiled code (training_step calls no forward of the root)
    forward = result.module_events("forward", region)[0]
    pre = result.module_events("pre-forward", region)[0]
    outputs = forward.live_bytes - pre.live_bytes - forward.saved_bytes
    assert forward.saved_bytes > 0 and outputs > 0  # the compiled graph's saved activations, and its outputs
    assert (
        result.peak_bytes >= max(e.live_bytes for e in result.events) and result.notes and "compiled" in result.notes[0]
    )
    assert "note: compiled model" in result.format_table()


def test_the_allocator_reading_equals_the_exact_accountant_on_an_eager_step(tmp_path):
    """Where both can run (an eager model), the peak from the allocator's events and the accountant's exact peak
    agree; the allocator also sees its own few bytes of bookkeeping, hence the small allowance."""
    from lightning_memkit import MemoryTracker

    readings = {}
    for how in (None, "keep"):
        torch.manual_seed(0)
        model = CompiledGPT2(compile=False)
        tracker = MemoryTracker(tensor_peak_every_n_steps=1, verbose=False)

        class _Measure(pl.Callback):
            def on_fit_start(self, trainer, pl_module, how=how, tracker=tracker):
                tracker._meter.compiled = how  # the allocator's events on an eager model, to compare

        _fit(model, tmp_path / str(how), [tracker, _Measure()], steps=3)
        readings[how] = [r.peak_tensor_bytes for r in tracker.history]
        del model, tracker
        gc.collect()
    for exact, allocator in zip(readings[None], readings["keep"], strict=True):
        assert 0 <= allocator - exact <= 256, readings


def test_tracker_layer_trace_and_doctor_together_keep_every_step_compiled_and_checkpointing_lowers_the_peak(
    rerun_in_own_process, tmp_path
):
    # a user's fit, from a fresh process: on torch 2.14.1, after this file's other compiled fits (the doctor's leaking
    # models among them) in the same process, two of this fit's four steps ran no compiled graph; alone, and on 2.13,
    # every step runs compiled (not explained yet)
    if rerun_in_own_process():
        return
    from lightning_memkit import LayerTrace, MemoryDoctor, MemoryTracker

    peaks = {}
    for checkpointed in (False, True):
        torch._dynamo.reset()
        backend = CountingBackend()
        torch.manual_seed(0)
        model = CompiledGPT2(backend=backend, layers=3)
        counts = GraphCallsPerStep(backend)
        tracker = MemoryTracker(tensor_peak_every_n_steps=1, verbose=False)
        callbacks = [
            tracker,
            LayerTrace(at_steps=(2,), verbose=False, figure=False),
            MemoryDoctor(verbose=False),
            counts,
        ]
        if checkpointed:
            callbacks.insert(0, ActivationCheckpointing("auto", verbose=False))
        _fit(model, tmp_path / str(checkpointed), callbacks, steps=4)
        assert len(counts.per_step) == 4 and min(counts.per_step) >= 1, counts.per_step
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
        assert callbacks[-3].results and callbacks[-2].report is not None and callbacks[-2].report.compiled
        peaks[checkpointed] = [r.peak_tensor_bytes for r in tracker.history]
        from lightning_memkit.compiled import _STREAM
        from lightning_memkit.compiled._torch_compat import profiler_active

        assert not _STREAM._readers and not profiler_active()  # nothing left recording after the fit
        assert None not in peaks[checkpointed]  # the shared profiler served the tracker while the others read it too
        del model, tracker, callbacks, counts, backend
        gc.collect()
    assert max(peaks[True][1:]) < min(peaks[False][1:]), peaks  # the compiled step's peak, lowered by checkpointing


def test_a_budgeted_trial_leaves_a_compiled_model_compiled_for_training():
    """MaxBatchSize's CPU trials count tensors under a MemoryBudget (a dispatch mode): the trial runs the eager
    program, and the model compiles at its next call outside it, as if the trial never happened."""
    from lightning_memkit.search.budget import MemoryBudget

    backend = CountingBackend("eager")
    layer = torch.nn.Linear(8, 8)
    compiled = torch.compile(layer, backend=backend)
    x = torch.randn(4, 8)
    with MemoryBudget(2**20) as budget:
        compiled(x).sum().backward()
    assert backend.compiled == 0 and budget.accountant.peak_bytes >= 4 * 8 * 4  # the trial ran eagerly, counted
    compiled(x).sum().backward()
    assert backend.compiled == 1 and backend.calls == 1


@pytest.mark.cuda
def test_on_cuda_the_tracker_reads_the_compiled_steps_max_memory_allocated(tmp_path):
    """GPU lane: on CUDA the tracker enters no dispatch mode; a compiled step's peak is the caching allocator's
    ``max_memory_allocated`` over the step, read here by the test itself at each batch end."""
    from lightning_memkit import MemoryTracker

    class _Allocator(pl.Callback):
        def __init__(self) -> None:
            self.peaks: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.peaks.append(torch.cuda.max_memory_allocated())

    backend = CountingBackend()
    torch.manual_seed(0)
    model = CompiledCNN(backend=backend)
    counts = GraphCallsPerStep(backend)
    tracker = MemoryTracker(verbose=False)
    allocator = _Allocator()
    _fit(model, tmp_path, [counts, tracker, allocator], steps=4, accelerator="cuda")
    assert min(counts.per_step) >= 1, counts.per_step
    assert [r.peak_allocated_bytes for r in tracker.history] == allocator.peaks
