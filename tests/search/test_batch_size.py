"""MaxBatchSize / find_max_batch_size: real Trainer trials under a CPU budget, state restored, bad input."""

from __future__ import annotations

import copy
import re
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memkit import is_out_of_memory
from lightning_memkit.callbacks.max_batch_size import MaxBatchSize, find_max_batch_size
from lightning_memkit.estimate import measure_training_step
from lightning_memkit.estimate.largest_batch import AffineGrowth
from lightning_memkit.search.batch_search import BatchSizeSearch, SearchError, Trial
from lightning_memkit.search.budget import BudgetExceededError, MemoryBudget
from lightning_memkit.zoo import DemoMLP, SyntheticDataModule
from tests.helpers.processes import run_script

FEATURES = 256


def _trainer(tmp_path, **kwargs):
    options = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 4,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def _setup(batch_size=8):
    torch.manual_seed(0)
    module = DemoMLP(in_features=FEATURES, hidden=128, depth=2)
    del module.batch_size  # the batch size lives on the datamodule
    return module, SyntheticDataModule(batch_size=batch_size, train_size=1024, val_size=16, input_shape=(FEATURES,))


def _budget_for(size):
    module, _ = _setup()
    return measure_training_step(
        module, size, batch=(torch.randn(2, FEATURES), torch.zeros(2, dtype=torch.int64))
    ).peak_bytes


def _fits(tmp_path, size, budget):
    module, data = _setup()
    try:
        find_max_batch_size(
            _trainer(tmp_path),
            module,
            data,
            budget=budget,
            init_val=size,
            max_val=size,
            max_trials=1,
            use_estimate=False,
            verbose=False,
        )
        return True
    except SearchError:
        return False


# ------------------------------------------------------------------------------ the search core
def _oracle(fixed, slope, capacity):
    def trial(size):
        peak = fixed + slope * size
        return Trial(size, peak <= capacity, int(peak) if peak <= capacity else None)

    return trial


def test_search_core_jumps_near_the_answer_and_returns_only_sizes_that_ran():
    fixed, slope, capacity = 50e6, 1e5, 50e6 + 1e5 * 1234.5
    growth = AffineGrowth(fixed * 1.1, slope * 1.02)  # a slightly wrong estimate
    search = BatchSizeSearch(
        _oracle(fixed, slope, capacity),
        capacity_bytes=int(capacity),
        growth=growth,
        predicted=growth.largest_fitting(capacity),
        max_val=100_000,
    )
    result = search.run()
    assert 0.95 * 1234 <= result.batch_size <= 1234 and result.reason == "converged"
    assert result.trial_count <= 4
    assert any(t.fits and t.batch_size == result.batch_size for t in result.trials)
    assert result.smallest_failure is not None and result.batch_size >= 0.95 * result.smallest_failure


def test_search_core_honours_init_val_and_max_val_and_fails_clearly():
    search = BatchSizeSearch(_oracle(0, 1, 1e9), init_val=3, max_val=40)
    result = search.run()
    assert result.trials[0].batch_size == 3 and result.batch_size == 40 and result.reason == "max_val"
    assert max(t.batch_size for t in result.trials) == 40
    with pytest.raises(SearchError, match="may not fit"):
        BatchSizeSearch(_oracle(100, 1, 50), capacity_bytes=50, max_val=64).run()
    with pytest.raises(ValueError, match="init_val=9 is larger than max_val=4"):
        BatchSizeSearch(_oracle(0, 1, 10), init_val=9, max_val=4)


def test_budget_fails_like_out_of_memory():
    budget = MemoryBudget(1000)
    with budget:
        small = torch.zeros(100)  # 400 bytes: fine
        with pytest.raises(BudgetExceededError) as caught:
            torch.zeros(200)  # 800 more: over
    assert is_out_of_memory(caught.value) and isinstance(caught.value, torch.OutOfMemoryError)
    assert caught.value.requested_bytes == 1200 and caught.value.budget_bytes == 1000 and budget.exceeded == 1
    assert budget.live_bytes == 400
    del small


# ------------------------------------------------------------------------------ real trials
def test_finder_returns_a_size_it_ran_within_5_percent_of_the_brute_force_maximum(tmp_path, capsys):
    budget = _budget_for(150)
    module, data = _setup()
    result = find_max_batch_size(_trainer(tmp_path), module, data, budget=budget, max_val=1024)
    found = result.batch_size
    assert data.batch_size == found
    assert any(t.fits and t.batch_size == found for t in result.trials)
    assert result.trial_count <= 4
    # brute force upwards from the answer: the first size that fails bounds the true maximum
    true_max = found
    while _fits(tmp_path, true_max + 1, budget):
        true_max += 1
    assert found >= 0.95 * true_max, (found, true_max)
    out = capsys.readouterr().out
    assert "memkit: trial 1: batch" in out and "peak" in out


class _RecordingSearch(MaxBatchSize):
    """Record the state right before and right after the search."""

    def on_fit_start(self, trainer, pl_module):
        self.before = self._state(trainer, pl_module)
        self.find(trainer, pl_module)
        self.after = self._state(trainer, pl_module)

    @staticmethod
    def _state(trainer, pl_module):
        return {
            "weights": {k: v.clone() for k, v in pl_module.state_dict().items()},
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()),
            "loop": copy.deepcopy(trainer.fit_loop.state_dict()),
            "global_step": trainer.global_step,
            "rng": torch.get_rng_state(),
            "callbacks": list(trainer.callbacks),
            "loggers": list(trainer.loggers),
        }


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_search_when_resumed_mid_training_runs_real_steps_and_restores_state_bit_for_bit(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    module, data = _setup(batch_size=32)
    first = _trainer(tmp_path, max_steps=4)
    first.fit(module, data)
    checkpoint = tmp_path / "mid.ckpt"
    first.save_checkpoint(checkpoint)
    finder = _RecordingSearch(budget=_budget_for(60), max_val=256, verbose=False)
    trainer = _trainer(tmp_path, max_steps=6, callbacks=[finder], logger=CSVLogger(tmp_path))
    trainer.fit(module, data, ckpt_path=checkpoint)
    # on_fit_start comes before Lightning restores the checkpoint: the search must not disturb that restore
    assert _equal(finder.before, finder.after)
    assert all(t.peak_bytes for t in finder.result.trials if t.fits)  # each trial ran its steps (else SearchError)
    assert trainer.global_step == 6  # the checkpoint (step 4) was restored after the search, training went on to 6
    assert data.batch_size == finder.result.batch_size


class _EpochStartSearch(_RecordingSearch):
    """Search when epoch 1 starts, after 4 real steps (Lightning's documented mid-training pattern)."""

    def on_fit_start(self, trainer, pl_module):
        pass

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            _RecordingSearch.on_fit_start(self, trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sizes = getattr(self, "sizes", []) + [(trainer.global_step, len(batch[0]))]


def test_search_started_mid_training_runs_real_steps_and_restores_state_bit_for_bit(tmp_path):
    module, data = _setup(batch_size=32)
    data.train_set.inputs, data.train_set.labels = data.train_set.inputs[:128], data.train_set.labels[:128]
    finder = _EpochStartSearch(budget=_budget_for(60), max_val=128, verbose=False)
    trainer = _trainer(tmp_path, max_steps=6, callbacks=[finder])
    trainer.fit(module, data)
    assert finder.before["global_step"] == 4 and finder.before["optimizer"]["state"]  # mid-training: Adam state exists
    assert _equal(finder.before, finder.after)
    found = finder.result.batch_size
    assert all(t.peak_bytes for t in finder.result.trials if t.fits)  # each trial ran its steps (else SearchError)
    assert finder.sizes == [
        (0, 32),
        (1, 32),
        (2, 32),
        (3, 32),
        (4, found),
        (5, found),
    ]  # training went on at the new size


def test_keep_effective_batch_size_raises_accumulation(tmp_path):
    module, data = _setup(batch_size=128)
    trainer = _trainer(tmp_path, accumulate_grad_batches=2)
    result = find_max_batch_size(
        trainer, module, data, budget=_budget_for(40), keep_effective_batch_size=True, verbose=False
    )
    assert data.batch_size * trainer.accumulate_grad_batches == 256
    assert data.batch_size <= result.batch_size and 256 % data.batch_size == 0


def test_bad_input_gets_clear_errors(tmp_path):
    module, data = _setup()
    fixed = DemoMLP(in_features=FEATURES)
    del fixed.batch_size
    fixed.hparams.pop("batch_size")
    fixed.train_dataloader = data.train_dataloader  # a loader with a hard-coded batch size
    with pytest.raises(MisconfigurationException, match="add self.batch_size"):
        find_max_batch_size(_trainer(tmp_path), fixed, None, budget=10**8)
    with pytest.raises(MisconfigurationException, match="passed straight to trainer.fit"):
        _trainer(tmp_path, callbacks=[MaxBatchSize(budget=10**8)]).fit(
            DemoMLP(), train_dataloaders=data.train_dataloader()
        )
    with pytest.raises(MisconfigurationException, match="smaller than the model's parameters"):
        find_max_batch_size(_trainer(tmp_path), module, data, budget=1000)
    with pytest.raises(MisconfigurationException, match="budget='lots'"):
        MaxBatchSize(budget="lots")


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning.pytorch as pl
    from lightning_memkit.callbacks.max_batch_size import find_max_batch_size
    from lightning_memkit.zoo import DemoMLP, SyntheticDataModule
    torch.manual_seed(0)
    module = DemoMLP(in_features=256, hidden=128, depth=2); del module.batch_size
    data = SyntheticDataModule(batch_size=8, train_size=2048, val_size=16, input_shape=(256,))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=sys.argv[1])
    budgets = [int(sys.argv[2]), int(sys.argv[3])]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    from torch.distributed import distributed_c10d  # private: only this test counts the process groups
    groups = []
    class CountGroups(pl.Callback):  # before the search: the search runs at fit start, in a fit that stops after it
        def setup(self, trainer, pl_module, stage):
            groups.append(len(distributed_c10d._world.pg_map))
    trainer.callbacks.append(CountGroups())
    result = find_max_batch_size(trainer, module, data, budget=budgets[rank], max_val=512, verbose=False)
    groups.append(len(distributed_c10d._world.pg_map))
    with open(os.path.join(sys.argv[1], f"rank{trainer.global_rank}.txt"), "w") as f:
        f.write(f"{result.batch_size} {len(result.trials)} {groups[0]} {groups[-1]}")
    """
)


def test_ddp_two_processes_agree_on_the_smaller_rank_limit(tmp_path):
    script = tmp_path / "ddp_search.py"
    script.write_text(DDP_SCRIPT)
    small, large = _budget_for(60), _budget_for(200)
    run_script(  # kills both ranks on timeout
        [str(script), str(tmp_path), str(large), str(small)], cwd=str(tmp_path), timeout=240, ranks=2
    )
    answers = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert answers[0] == answers[1], answers
    assert answers[0][2] == answers[0][3], answers  # the search's own gloo group is destroyed after it
    size = int(answers[0][0])
    assert 0.9 * 60 <= size <= 62, size  # rank 1's smaller budget decides (per-rank batch, DDP adds nothing per sample)


def test_trials_run_in_the_checkpointing_mode_the_trainer_will_train_in(tmp_path):
    """With ActivationCheckpointing on the Trainer, the trials (which run with no callbacks) wrap the
    module themselves: the answer is larger than without, and the module is unwrapped afterwards."""
    from lightning_memkit import ActivationCheckpointing
    from lightning_memkit.modes.checkpoint_wrap import is_checkpointed

    def setup():
        torch.manual_seed(0)
        module = DemoMLP(in_features=FEATURES, hidden=128, depth=8)  # a chain 'auto' cuts into 4 segments
        del module.batch_size
        return module, SyntheticDataModule(batch_size=8, train_size=1024, val_size=16, input_shape=(FEATURES,))

    module, data = setup()
    budget = measure_training_step(
        module, 300, batch=(torch.randn(2, FEATURES), torch.zeros(2, dtype=torch.int64))
    ).peak_bytes
    plain = find_max_batch_size(_trainer(tmp_path), module, data, budget=budget, max_val=1024, verbose=False)
    module, data = setup()
    trainer = _trainer(tmp_path, callbacks=[ActivationCheckpointing("auto", verbose=False)])
    checkpointed = find_max_batch_size(trainer, module, data, budget=budget, max_val=1024, verbose=False)
    assert checkpointed.batch_size > 1.1 * plain.batch_size, (plain.batch_size, checkpointed.batch_size)
    assert any(t.fits and t.batch_size == checkpointed.batch_size for t in checkpointed.trials)
    assert not any(is_checkpointed(m) for m in module.modules())


def test_a_search_stopped_by_the_dataset_says_so(tmp_path, capsys):
    torch.manual_seed(0)
    module = DemoMLP(in_features=FEATURES, hidden=128, depth=2)
    del module.batch_size
    data = SyntheticDataModule(batch_size=8, train_size=48, val_size=16, input_shape=(FEATURES,))
    result = find_max_batch_size(_trainer(tmp_path), module, data, budget=_budget_for(150), max_val=1024)
    assert result.batch_size == 48 and result.reason == "dataset" and data.batch_size == 48
    assert (
        "no larger batch: the train dataset has 48 samples (the dataset, not memory, bounds it); using 48"
        in capsys.readouterr().out
    )


# ------------------------------------------------------------------------------ as a Lightning user writes it
def test_a_schedule_from_self_trainer_and_a_datamodule_set_up_in_setup_are_searched_with_the_estimate(tmp_path):
    """TinyGPT sizes its cosine schedule from self.trainer.estimated_stepping_batches and its datamodule
    makes its dataset in setup(): the estimate works inside the search (no 'could not estimate' fallback),
    so the search needs at most 4 real trials, and the answer ran."""
    import warnings

    from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

    torch.manual_seed(0)
    module, data = TinyGPT(), CharDataModule(batch_size=8, samples=1024)
    budget = measure_training_step(module, 40, datamodule=data).peak_bytes
    finder = MaxBatchSize(budget=budget, max_val=1024, verbose=False)
    trainer = _trainer(tmp_path, max_steps=2, callbacks=[finder])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "memkit: could not estimate the step" would fail here
        trainer.fit(module, data)
    result = finder.result
    assert result.predicted is not None and abs(result.predicted - 40) <= 2, result.predicted
    assert result.trial_count <= 4 and any(t.fits and t.batch_size == result.batch_size for t in result.trials)
    assert 0.95 * 40 <= result.batch_size <= 41 and data.batch_size == result.batch_size
    assert trainer.global_step == 2  # training went on, with the schedule Lightning built


def test_the_search_leaves_no_tensor_behind(tmp_path):
    """After the search (trials that fit and one that ran out of memory), the process holds exactly the
    tensors it held before: no trial batch, no logged loss, no gradient, no autograd graph."""
    from tests.helpers.live_tensors import live_tensor_bytes, tensors_with_grad_fn

    module, data = _setup()
    trainer = _trainer(tmp_path)
    budget = _budget_for(150)
    before = live_tensor_bytes()
    result = find_max_batch_size(trainer, module, data, budget=budget, max_val=1024, verbose=False)
    assert any(not t.fits for t in result.trials)  # the out-of-memory path ran
    assert tensors_with_grad_fn() == []
    assert all(p.grad is None for p in module.parameters())
    assert live_tensor_bytes() == before


def test_the_search_core_stops_before_a_trial_that_would_run_past_max_seconds():
    def trial(size):  # fits up to 10_000, takes 0.01 s per sample
        return Trial(size, size <= 10_000, size if size <= 10_000 else None, seconds=0.01 * size)

    result = BatchSizeSearch(trial, init_val=100, max_val=100_000, max_seconds=10.0).run()
    assert result.reason == "time" and result.batch_size == 400  # 1 + 2 + 4 s spent; 800 would need 8 s more
    assert sum(t.seconds for t in result.trials) <= 10.0 + 1e-9
    with pytest.raises(ValueError, match="max_seconds"):
        BatchSizeSearch(trial, max_seconds=0)


START = re.compile(r"^memkit: trial (\d+): batch (\d+) starts(?: \([^)]*\))?, at most ([\d.]+)s", re.M)
END = re.compile(
    r"^memkit: trial (\d+): batch (\d+) -> (fits|out of memory|too slow), peak ([^(]+) \(([\d.]+)s\)$", re.M
)


def trial_lines(out):
    """[(trial, batch, limit s)] of the start lines and [(trial, batch, outcome, seconds)] of the end lines, in
    order."""
    starts = [(int(n), int(b), float(limit)) for n, b, limit in START.findall(out)]
    ends = [(int(n), int(b), outcome, float(seconds)) for n, b, outcome, _, seconds in END.findall(out)]
    return starts, ends


def test_a_cpu_search_without_budget_bounds_every_trial_and_prints_it(tmp_path, capsys):
    """No budget= on CPU: the announcement says what bounds the search (host memory, seconds per trial and in all),
    the first trial is small (it times a step), every trial prints a line as it starts and as it ends, none runs past
    its announced limit, later sizes grow at most 4x, and the process's peak resident memory stays under the host
    memory announced."""
    from lightning_memkit.probes.host import HostProbe
    from lightning_memkit.units import parse_bytes

    torch.manual_seed(0)
    module = DemoMLP(in_features=FEATURES, hidden=128, depth=2)
    del module.batch_size
    data = SyntheticDataModule(batch_size=8, train_size=512, val_size=16, input_shape=(FEATURES,))
    probe = HostProbe()
    probe.reset_peak()
    result = find_max_batch_size(_trainer(tmp_path), module, data, max_val=256)
    peak_rss = probe.read()["host_peak_rss_bytes"]
    out = capsys.readouterr().out
    [announced] = re.findall(r"^memkit: no budget= on CPU: .*$", out, flags=re.M)
    assert "each trial runs at most 20s and all trials 60s" in announced, announced
    assert "the first trial is at most batch 4" in announced
    host = parse_bytes(re.search(r"host memory stays under ([\d.]+ [KMG]iB)", announced).group(1).replace(" ", ""))
    assert probe.peak_is_per_step and peak_rss <= host * 1.005, (
        peak_rss,
        host,
    )  # the announced figure is rounded to 3 digits
    starts, ends = trial_lines(out)
    assert len(starts) == len(ends) == result.trial_count >= 3
    assert (
        [(n, b) for n, b, _ in starts]
        == [(n, b) for n, b, _, _ in ends]
        == [(i + 1, t.batch_size) for i, t in enumerate(result.trials)]
    )
    assert starts[0][1] <= 4 and "(small: it times a step)" in out
    assert all(limit == 20 for _, _, limit in starts)
    assert all(t.seconds <= 20 for t in result.trials)
    for index, trial in enumerate(result.trials[1:], start=1):
        ran = [t.batch_size for t in result.trials[:index] if t.fits]
        assert trial.batch_size <= 4 * max(ran), (trial.batch_size, ran)
    assert result.batch_size == 256 and result.reason == "max_val"
    shapes = result.proved_trial().batch_shapes
    assert (
        shapes.startswith("batch[0] (256, ")
        and f"memkit: batch size 256 fits on {shapes} ({result.trial_count} trials" in out
    )


SLOW_STEP_S = 3.3  # a step above the cliff: more than half a trial's limit (6 s), so one step is all that runs


class _SlowAbove(DemoMLP):
    """A step that takes 3.3 s above ``fast_up_to`` samples (a cache cliff: the seconds per sample measured below it do
    not foretell it)."""

    def __init__(self, fast_up_to, **kwargs):
        super().__init__(**kwargs)
        self.fast_up_to = fast_up_to

    def training_step(self, batch, batch_idx):
        import time

        time.sleep(SLOW_STEP_S if batch[0].shape[0] > self.fast_up_to else 0.02)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "fast_up_to",
    [
        pytest.param(8, id="cliff-above-8"),
        # the same deadline on the first trial: 20 s of sleeping steps, in make test-extended
        pytest.param(0, id="slow-from-the-first", marks=pytest.mark.extended),
    ],
)
def test_a_trial_whose_next_step_would_pass_its_limit_is_stopped_and_ends_the_search(
    fast_up_to, tmp_path, capsys, monkeypatch
):
    """A trial may run 6 s; a step above the cliff takes 3.3 s: after its first step the next would end past 6 s, so the
    trial stops there (too slow) and the search ends with the largest size that ran in time, or, when even the first
    (small) trial was too slow, with that size (its step ran without running out of memory): training goes on."""
    from lightning_memkit.search import limits

    # 6 s, not less: the steps below the cliff (20 ms of sleep and a tiny MLP) took 0.6 s each in a niced process on a
    # loaded 2-core machine, and three of them must fit in a trial
    monkeypatch.setattr(limits, "CPU_TRIAL_SECONDS", 6.0)
    torch.manual_seed(0)
    module = _SlowAbove(fast_up_to, in_features=FEATURES, hidden=64, depth=1)
    del module.batch_size
    data = SyntheticDataModule(batch_size=8, train_size=512, val_size=16, input_shape=(FEATURES,))
    trainer = _trainer(tmp_path)
    result = find_max_batch_size(trainer, module, data, max_val=256)
    out = capsys.readouterr().out
    starts, ends = trial_lines(out)
    assert all(limit == 6 for _, _, limit in starts) and len(starts) == len(ends) == result.trial_count
    [slow] = [t for t in result.trials if not t.fits]
    assert slow is result.trials[-1] and slow.batch_size > fast_up_to
    assert "the next would end past the trial's limit of 6s (1 of 3 steps ran)" in slow.error, slow.error
    assert ends[-1][2] == "too slow" and all(outcome == "fits" for _, _, outcome, _ in ends[:-1])
    ran = [t.batch_size for t in result.trials if t.fits]
    assert result.batch_size == (max(ran) if fast_up_to else slow.batch_size) == data.batch_size
    assert result.reason == "time" and "too slow" in result.table()
    assert "(time, not memory, bounds it" in out
    assert all(type(c).__name__ != "_Deadline" for c in trainer.callbacks)  # no deadline left behind


class _ToggledGAN(pl.LightningModule):
    """Manual optimization with Lightning's toggle_optimizer: while one optimizer steps, the other's parameters
    have requires_grad=False until untoggle_optimizer, which a trial that runs out of memory mid-step never reaches."""

    def __init__(self, batch_size=4):
        super().__init__()
        self.automatic_optimization = False
        self.batch_size = batch_size
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], 8))
        self.toggle_optimizer(d_opt)
        d_loss = (
            torch.nn.functional.softplus(self.discriminator(fake.detach())).mean()
            + torch.nn.functional.softplus(-self.discriminator(real)).mean()
        )
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        self.untoggle_optimizer(d_opt)
        self.toggle_optimizer(g_opt)
        g_loss = torch.nn.functional.softplus(-self.discriminator(fake)).mean()
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()
        self.untoggle_optimizer(g_opt)

    def configure_optimizers(self):
        return torch.optim.Adam(self.generator.parameters(), lr=1e-3), torch.optim.Adam(
            self.discriminator.parameters(), lr=1e-3
        )

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(4096, 64, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


@pytest.mark.parametrize("use_estimate", [True, False], ids=["estimate", "trials-only"])
def test_a_trial_out_of_memory_between_toggle_and_untoggle_leaves_every_parameter_trainable(use_estimate, tmp_path):
    # a trial stopped mid-step by the budget never reaches untoggle_optimizer: the parameters it froze must be
    # trainable again for the next trial and for training (else: 'element 0 ... does not require grad')
    torch.manual_seed(0)
    module = _ToggledGAN()
    flags = {name: p.requires_grad for name, p in module.named_parameters()}
    finder = MaxBatchSize(budget=600_000, max_val=4096, use_estimate=use_estimate, verbose=False)
    trainer = _trainer(tmp_path, max_steps=6, callbacks=[finder])
    trainer.fit(module)
    assert any(not trial.fits for trial in finder.result.trials)  # some trial did run out of memory
    assert trainer.global_step == 6 and {name: p.requires_grad for name, p in module.named_parameters()} == flags


def test_a_search_without_a_prediction_says_why_not_predicted_none(tmp_path, capsys):
    """No "predicted None": the search's line and its table say the estimate was unavailable, and why."""
    module, data = _setup()
    result = find_max_batch_size(
        _trainer(tmp_path), module, data, budget=_budget_for(150), max_val=64, use_estimate=False
    )
    out = capsys.readouterr().out
    assert "memkit: the estimate was unavailable (use_estimate=False): the search goes by trials alone" in out
    assert result.predicted is None and result.estimate_unavailable == "use_estimate=False"
    head = result.table().splitlines()[0]
    assert "the estimate was unavailable (use_estimate=False)" in head and "None" not in head
