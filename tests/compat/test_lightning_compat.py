"""Pins the private Lightning internals memkit reads (lightning_memkit/_lightning_compat.py).

If a Lightning release moves one of them, these tests say which wrapper is wrong.
"""

from __future__ import annotations

import types

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit._lightning_compat import attached_trainer, logging_step, optimizer_steps_after_batch
from tests.helpers.event_files import read_scalars
from tests.helpers.models import LinearStack
from tests.helpers.trainers import make_trainer


class _Recorder(pl.Callback):
    def __init__(self):
        self.train_steps, self.val_steps, self.ends = [], [], []
        self._started_at = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.train_steps.append(logging_step(trainer))
        self._started_at = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stepped = trainer.global_step > self._started_at  # the optimizer really stepped
        self.ends.append((optimizer_steps_after_batch(trainer), stepped, logging_step(trainer)))

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_steps.append(logging_step(trainer))


def test_logging_step_is_the_step_lightning_logs_self_log_at(tmp_path):
    recorder = _Recorder()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(
        tmp_path,
        max_steps=6,
        logger=logger,
        callbacks=[recorder],
        val_check_interval=2,
        limit_val_batches=1,
        check_val_every_n_epoch=None,
    )
    trainer.fit(LinearStack(log_loss=True))
    scalars = read_scalars(logger.log_dir)
    assert recorder.train_steps == [s for s, _ in scalars["train_loss"]] == list(range(6))
    assert recorder.val_steps == [s for s, _ in scalars["val_loss"]] == [1, 3, 5]
    # the same step holds through the batch: on_train_batch_end still sees it
    assert [step for _, _, step in recorder.ends] == list(range(6))


def test_optimizer_steps_after_batch_matches_accumulation(tmp_path):
    # 7 batches per epoch (56 samples / 8), accumulate 3: steps after batches 3, 6 and the
    # epoch's last (7), which Lightning always steps on; then the next epoch starts afresh
    recorder = _Recorder()
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = make_trainer(tmp_path, max_steps=5, accumulate_grad_batches=3, logger=logger, callbacks=[recorder])
    trainer.fit(LinearStack(samples=56, log_loss=True))
    predicted = [p for p, _, _ in recorder.ends]
    actual = [s for _, s, _ in recorder.ends]
    assert predicted == actual
    assert actual == [False, False, True, False, False, True, True, False, False, True, False, False, True]
    # every micro-batch of one optimizer step shares its logging step, which is the step
    # Lightning writes the (micro-batch) train_loss at
    assert recorder.train_steps == [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4, 4, 4]
    assert sorted({s for s, _ in read_scalars(logger.log_dir)["train_loss"]}) == [0, 1, 2, 3, 4]


def test_wrappers_fall_back_when_the_internals_are_missing():
    trainer = types.SimpleNamespace(global_step=7)
    assert logging_step(trainer) == 7
    assert optimizer_steps_after_batch(trainer) is True


def test_the_stand_in_trainer_answers_what_a_real_trainer_answers(tmp_path):
    """estimated_stepping_batches (and the settings it reads) of a real fit, against the estimate's stand-in
    built from the same settings, for epochs-, steps- and accumulation-bound runs."""
    from lightning_memkit.estimate.step.trainer_stand_in import StandInTrainer

    class Read(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            self.real = (
                trainer.estimated_stepping_batches,
                trainer.max_steps,
                trainer.max_epochs,
                trainer.num_devices,
                trainer.world_size,
                str(trainer.precision),
                trainer.global_step,
                trainer.current_epoch,
            )
            # the estimate gives the stand-in the train loader's length, as memkit does with the batch it samples
            self.stand_in = StandInTrainer.like(trainer, num_training_batches=len(pl_module.train_dataloader()))

    for options in (
        {"max_steps": -1, "max_epochs": 3},
        {"max_steps": 5},
        {"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 3},
        {"max_steps": -1, "max_epochs": -1, "limit_train_batches": 2},
        {"max_steps": -1, "max_epochs": 1, "accumulate_grad_batches": 2},
    ):
        reader = Read()
        trainer = make_trainer(tmp_path, callbacks=[reader], **options)
        if options.get("max_epochs") == -1:  # an endless fit: read the settings, do not run it
            trainer.fit_loop.epoch_loop.max_steps = 1
        trainer.fit(LinearStack(samples=56))  # 7 batches per epoch
        stand_in = reader.stand_in
        assert (
            stand_in.estimated_stepping_batches,
            stand_in.max_steps,
            stand_in.max_epochs,
            stand_in.num_devices,
            stand_in.world_size,
            stand_in.precision,
            stand_in.global_step,
            stand_in.current_epoch,
        ) == reader.real, options


def test_the_trial_clean_up_wrappers_find_what_they_clear(tmp_path):
    """The private fit-loop attributes the batch-size search clears after a trial exist where the wrappers look."""
    from lightning_memkit._lightning_compat import (
        clear_logged_results,
        drop_train_data_fetcher,
        logged_metrics_state,
        restore_logged_metrics,
    )

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            results = trainer.fit_loop.epoch_loop._results
            assert results.batch is batch and trainer.fit_loop._data_fetcher is not None  # what a trial leaves behind
            clear_logged_results(trainer)
            drop_train_data_fetcher(trainer)
            assert results.batch is None and trainer.fit_loop._data_fetcher is None
            trainer.should_stop = True

        def on_train_end(self, trainer, pl_module):
            saved = logged_metrics_state(trainer)
            assert set(saved) == {"_callback_metrics", "_logged_metrics", "_progress_bar_metrics"}
            restore_logged_metrics(trainer, {"_callback_metrics": {"kept": 1.0}, "_progress_bar_metrics": {}})
            assert trainer.callback_metrics == {"kept": 1.0} and trainer.progress_bar_metrics == {}
            self.ran = True

    check = Check()
    make_trainer(tmp_path, max_steps=2, callbacks=[check]).fit(LinearStack(log_loss=True))
    assert check.ran


def test_lightning_binds_the_modules_logging_on_callbacks_and_forget_model_logging_drops_it(tmp_path):
    """Pins the Lightning behaviour forget_model_logging exists for: at fit start every callback gets
    the module's bound ``log``/``log_dict`` (which keep the module alive), and nothing removes them."""
    from lightning.pytorch import Callback

    from lightning_memkit._lightning_compat import forget_model_logging
    from tests.helpers.models import LinearStack
    from tests.helpers.trainers import make_trainer

    callback = Callback()
    model = LinearStack()
    make_trainer(tmp_path, max_steps=1, callbacks=[callback]).fit(model)
    assert vars(callback)["log"].__self__ is model and vars(callback)["log_dict"].__self__ is model
    forget_model_logging(callback)
    assert "log" not in vars(callback) and "log_dict" not in vars(callback)


def test_manual_optimizers_and_schedulers_read_every_configure_optimizers_shape():
    from lightning_memkit._lightning_compat import manual_optimizers_and_schedulers

    model = LinearStack()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    second = torch.optim.Adam(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)
    assert manual_optimizers_and_schedulers(first) == ([first], [])
    optimizers, configs = manual_optimizers_and_schedulers(([first, second], [scheduler]))
    assert optimizers == [first, second] and [c.scheduler for c in configs] == [scheduler]
    optimizers, configs = manual_optimizers_and_schedulers(
        {"optimizer": first, "lr_scheduler": {"scheduler": scheduler}}
    )
    assert optimizers == [first] and [c.scheduler for c in configs] == [scheduler]


def test_automatic_optimizers_and_schedulers_read_what_fit_sets_up():
    from lightning_memkit._lightning_compat import automatic_optimizers_and_schedulers

    model = LinearStack()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1)
    assert automatic_optimizers_and_schedulers(first) == ([first], [])
    optimizers, configs = automatic_optimizers_and_schedulers({"optimizer": first, "lr_scheduler": scheduler})
    assert optimizers == [first] and [c.scheduler for c in configs] == [scheduler]
    assert configs[0].interval == "epoch"  # the automatic defaults, as Trainer.fit fills them in


def test_prefetched_batches_is_the_batch_the_next_step_receives(tmp_path):
    """Pins ``fit_loop._data_fetcher.batches``: with an iterable train loader (no length) Lightning's fetcher
    fetches one batch ahead, and that batch is the next step's batch (the same tensors, on CPU); with a sized
    loader it fetches none; without a fit running the wrapper falls back to ``[]``."""
    from torch.utils.data import DataLoader, IterableDataset

    from lightning_memkit._lightning_compat import prefetched_batches

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.randn(8, 32).split(2))

    class Iterable(LinearStack):
        def train_dataloader(self):
            return DataLoader(Stream(), batch_size=None, collate_fn=lambda x: (x,))

    class Check(pl.Callback):
        def __init__(self):
            self.ahead, self.received = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.received.append(batch[0])
            self.ahead.append([each[0][0] for each in prefetched_batches(trainer)])

    check = Check()
    make_trainer(tmp_path, max_steps=3, callbacks=[check]).fit(Iterable())
    assert [len(ahead) for ahead in check.ahead] == [1, 1, 1]
    assert all(ahead[0] is received for ahead, received in zip(check.ahead[:-1], check.received[1:], strict=True))
    sized = Check()
    make_trainer(tmp_path, max_steps=2, callbacks=[sized]).fit(LinearStack())
    assert sized.ahead == [[], []]
    assert prefetched_batches(types.SimpleNamespace()) == []


def test_train_loader_and_use_train_loader_swap_the_loader_the_next_fit_loop_run_iterates(tmp_path):
    """Pins ``fit_loop._combined_loader.flattened`` (read and replaced) and ``fit_loop._data_fetcher`` (its iterator
    made anew): in ``on_fit_start`` (where MaxBatchSize's trials run), after ``reload_train_dataloader``, the fit
    loop's run trains on the loader given; the next reload puts the module's own back."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memkit._lightning_compat import reload_train_dataloader, train_loader, use_train_loader

    class Swap(pl.Callback):
        def __init__(self):
            self.first, self.own, self.marked, self.back = [], None, None, None

        def on_fit_start(self, trainer, pl_module):
            reload_train_dataloader(trainer)
            self.own = train_loader(trainer)
            features = self.own.dataset[0][0].shape[0]
            self.marked = DataLoader(TensorDataset(torch.full((4, features), 7.0)), batch_size=2)
            use_train_loader(trainer, self.marked)
            assert train_loader(trainer) is self.marked

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.first.append(float(batch[0][0, 0]))

        def on_train_end(self, trainer, pl_module):
            reload_train_dataloader(trainer)
            self.back = train_loader(trainer)

    swap = Swap()
    make_trainer(tmp_path, max_steps=2, callbacks=[swap]).fit(LinearStack())
    assert isinstance(swap.own, DataLoader) and swap.first == [7.0, 7.0]  # trained on the loader given
    assert swap.back is not swap.marked and isinstance(swap.back, DataLoader)


def test_attached_trainer_is_the_trainer_a_fit_attached_and_none_before_and_after_detaching(tmp_path):
    """``attached_trainer`` reads ``LightningModule._trainer``: the Trainer a fit attached (the public ``trainer``
    property raises when there is none), ``None`` on a fresh module and after the public setter detached it."""
    module = LinearStack((4, 8, 2), batch_size=2)
    assert attached_trainer(module) is None
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(module)
    assert attached_trainer(module) is trainer and module.trainer is trainer
    module.trainer = None
    assert attached_trainer(module) is None


def test_copy_module_reads_what_lightnings_from_compiled_keeps():
    """``copy_module`` reads ``from_compiled``'s ``_compiler_ctx``: the dynamo context and each step method as a
    bound method of the module, the compiled wrappers put on the instance. A copy for an eager step gets the class's
    methods back, bound to the copy; a copy for a trial gets the wrappers again, of the copy's methods, with the
    same dynamo context."""
    from lightning.pytorch.utilities.compile import from_compiled

    from lightning_memkit._lightning_compat import copy_module
    from lightning_memkit.compiled._torch_compat import compiled_function

    torch.manual_seed(0)
    compiled = torch.compile(LinearStack((4, 8, 2), batch_size=2), backend="eager")
    module = from_compiled(compiled)
    context = module._compiler_ctx
    assert context["dynamo_ctx"] is compiled.dynamo_ctx
    for name in ("forward", "training_step", "validation_step", "test_step", "predict_step"):
        assert context[f"original_{name}"].__self__ is module
        assert compiled_function(vars(module)[name])
    eager = copy_module(module, compiled=False)
    assert "training_step" not in vars(eager) and eager._compiler_ctx is None
    assert eager.training_step.__func__ is LinearStack.training_step and eager.training_step.__self__ is eager
    trial = copy_module(module)
    assert compiled_function(vars(trial)["training_step"])
    assert trial._compiler_ctx["dynamo_ctx"] is compiled.dynamo_ctx
    assert trial._compiler_ctx["original_training_step"].__self__ is trial
    assert module._compiler_ctx["original_training_step"].__self__ is module  # the original's is untouched


def test_the_strategy_settings_the_per_rank_estimate_reads_are_lightnings():
    """ModelParallelStrategy gives configure_model its mesh through ``_device_mesh``; FSDPStrategy derives FSDP's
    MixedPrecision from the precision; DDPStrategy keeps DDP's keyword arguments in ``_ddp_kwargs``."""
    import torch
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_memkit._lightning_compat import ddp_kwargs, fsdp_mixed_precision, give_device_mesh

    module = LightningModule()
    give_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"
    assert fsdp_mixed_precision("bf16-mixed").param_dtype == torch.bfloat16
    assert fsdp_mixed_precision("32-true").reduce_dtype == torch.float32
    assert ddp_kwargs(DDPStrategy(bucket_cap_mb=5, gradient_as_bucket_view=True)) == {
        "bucket_cap_mb": 5,
        "gradient_as_bucket_view": True,
    }
    assert ddp_kwargs(object()) == {}
