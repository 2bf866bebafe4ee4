"""``memkit estimate``: one table, a row per mode, numbers equal to the library's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from lightning_memkit.cli import main
from lightning_memkit.cli.estimate_figures import BREAKDOWN_HEADERS
from lightning_memkit.cli.estimate_output import KERNELS_PREFIX
from lightning_memkit.estimate import estimate_batch_split, estimate_memory, predict_max_batch_size
from lightning_memkit.units import format_bytes


def _table(text: str, header_word: str) -> tuple[list[str], dict[tuple[str, ...], list[str]]]:
    """The printed table whose header starts with ``header_word``: its header cells and rows by the first cells
    (columns are separated by two or more spaces; a size such as ``1.50 MiB`` is one cell)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_word))
    header = re.split(r"\s{2,}", lines[start].strip())
    rows = {}
    for line in lines[start + 2 :]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(header):
            break
        rows[tuple(cells[:2]) if header[1] == "mode" else (cells[0],)] = cells
    return header, rows


def test_estimate_table_has_a_row_per_mode_matching_the_library(tmp_path, capsys):
    out_json = tmp_path / "estimate.json"
    status = main(
        [
            "estimate",
            "lightning_memkit/zoo.py:DemoMLP",
            "--device-memory",
            "64MiB",
            "--device",
            "cpu",
            "--modes",
            "baseline,bf16",
            "--json",
            str(out_json),
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    header, rows = _table(out, "mode")
    assert header == [
        "mode",
        "batch",
        "allocated",
        "reserved",
        "device needs",
        "batch 1 needs",
        "max batch",
        "needs at max",
    ]
    assert {key[0] for key in rows} == {"baseline", "bf16"}
    from lightning_memkit.zoo import DemoMLP

    estimate = estimate_memory(DemoMLP(), mode="baseline", device="cpu")
    prediction = predict_max_batch_size(DemoMLP(), 64 * 2**20, mode="baseline", device="cpu")
    split = estimate_batch_split(DemoMLP(), 32, mode="baseline", device="cpu")
    baseline = rows[("baseline",)]
    assert baseline[1] == "32"
    # on a CPU target the allocated figure is the tensor peak and there is no caching allocator to reserve
    assert baseline[2:5] == [format_bytes(estimate.peak_bytes), "-", format_bytes(estimate.required_bytes)]
    assert baseline[5:7] == [format_bytes(split.batch_one_required_bytes), str(prediction.batch_size)]
    # each mode's breakdown: the categories at the peak, at batch 1, and what one more sample adds
    title = next(line for line in out.splitlines() if line.startswith("baseline: tensor bytes at the peak"))
    assert f"(batch 32, {estimate.peak_phase} of step {estimate.peak_step})" in title
    header, categories = _table(out[out.index(title) :], "category")
    assert header == list(BREAKDOWN_HEADERS)
    columns = (estimate.by_category, split.batch_one_by_category, split.per_sample_by_category)
    for name in estimate.by_category:
        if any(column[name] for column in columns):
            assert categories[(name,)][1:] == [format_bytes(column[name]) for column in columns], name
        else:
            assert (name,) not in categories
    assert categories[("parameters",)][3] == "0 B"
    assert categories[("peak (tensors)",)][1:] == [
        format_bytes(estimate.peak_bytes),
        format_bytes(split.batch_one_bytes),
        format_bytes(split.per_sample_bytes),
    ]
    data = json.loads(out_json.read_text())
    result = data["results"][0]
    assert result["estimate"]["peak_bytes"] == estimate.peak_bytes
    assert result["estimate"]["by_category"] == estimate.by_category
    assert result["max_batch"]["batch_size"] == prediction.batch_size and result["fits"] is True
    assert result["batch_split"] == split.to_dict() and "mode_needs" not in data


#: a transformer small enough for a CUDA-target estimate in a second (on CPU fakes)
TINY = {"vocab_size": 64, "d_model": 32, "nhead": 2, "layers": 1, "dim_feedforward": 64, "seq_len": 16, "batch_size": 4}


def test_true_half_precision_modes_print_and_write_the_librarys_figures(tmp_path, capsys):
    """--modes bf16-true,fp16-true: a row each with the library's figures (the module built on the meta device, the
    library's with its weights), lower than mixed precision's."""
    from lightning_memkit.zoo import DemoTransformer

    modes = ("bf16", "bf16-true", "fp16-true")
    out_json = tmp_path / "half.json"
    arguments = ["estimate", "lightning_memkit/zoo.py:DemoTransformer", "--init-args", json.dumps(TINY), "--meta-init"]
    arguments += ["--device-memory", "16MiB", "--device", "cpu", "--modes", ",".join(modes), "--json", str(out_json)]
    assert main(arguments) == 0
    _, rows = _table(capsys.readouterr().out, "mode")
    assert {key[0] for key in rows} == set(modes)
    estimate = estimate_memory(DemoTransformer(**TINY), mode="bf16-true", device="cpu")
    prediction = predict_max_batch_size(DemoTransformer(**TINY), 16 * 2**20, mode="bf16-true", device="cpu")
    assert rows[("bf16-true",)][2] == format_bytes(estimate.peak_bytes)
    assert rows[("bf16-true",)][6] == str(prediction.batch_size)
    data = json.loads(out_json.read_text())["results"]
    assert [r["mode"] for r in data] == list(modes) and data[1]["estimate"]["mode"] == "bf16-true"
    peaks = {r["mode"]: r["estimate"]["peak_bytes"] for r in data}
    assert peaks["bf16-true"] == estimate.peak_bytes == peaks["fp16-true"] < peaks["bf16"]
    assert data[1]["max_batch"]["batch_size"] == prediction.batch_size


def test_cuda_target_prints_reserved_beside_allocated_and_the_kernels_each_gpu_picks(tmp_path, capsys):
    """--gpu reaches the kernel table: an H100 runs bf16 attention through flash, a V100 (sm70) cannot; every
    figure printed is the library's own estimate for that GPU."""
    from lightning_memkit.zoo import DemoTransformer

    printed = {}
    for gpu in ("h100", "v100"):
        out_json = tmp_path / f"{gpu}.json"
        status = main(
            [
                "estimate",
                "lightning_memkit/zoo.py:DemoTransformer",
                "--init-args",
                json.dumps(TINY),
                "--device-memory",
                "1GiB",
                "--modes",
                "bf16",
                "--gpu",
                gpu,
                "--json",
                str(out_json),
            ]
        )
        out = capsys.readouterr().out
        assert status == 0
        header, rows = _table(out, "mode")
        assert header[2:5] == ["allocated", "reserved", "device needs"]
        estimate = estimate_memory(DemoTransformer(**TINY), mode="bf16", device="cuda", gpu=gpu)
        assert rows[("bf16",)][2:5] == [
            format_bytes(estimate.cuda.peak_allocated_bytes),
            format_bytes(estimate.cuda.peak_reserved_bytes),
            format_bytes(estimate.required_bytes),
        ]
        assert json.loads(out_json.read_text())["results"][0]["estimate"]["cuda"] == estimate.cuda.to_dict()
        kernels = [line for line in out.splitlines() if line.startswith("kernels assumed")]
        (note,) = [n for n in estimate.notes if n.startswith(KERNELS_PREFIX)]
        assert kernels == ["kernels assumed (bf16): " + note[len(KERNELS_PREFIX) :]]
        assert f"on cuda ({gpu}, sm" in out.splitlines()[0]
        printed[gpu] = (kernels[0], estimate.cuda.peak_allocated_bytes)
    assert "attention: flash" in printed["h100"][0] and "attention: flash" not in printed["v100"][0]
    assert printed["h100"][1] != printed["v100"][1]  # and the cuBLAS workspace differs (32 MiB from sm90)


def test_estimate_bad_input_says_what_to_do(capsys):
    assert main(["estimate", "no_such_file.py:Model", "--device-memory", "1GiB"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "lots"]) == 2
    assert "16GiB" in capsys.readouterr().err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "1GiB", "--modes", "ampp"]) == 2
    assert "unknown mode word" in capsys.readouterr().err


def test_estimate_takes_a_datamodule_and_equals_the_measured_step(tmp_path, capsys):
    """A LightningModule whose configure_optimizers reads self.trainer.estimated_stepping_batches, fed by a
    LightningDataModule that makes its dataset in setup(): the CLI's figure is the measured step's, to the byte."""
    from lightning_memkit.estimate import measure_training_step
    from tests.helpers.lightning_gpt import CharDataModule, TinyGPT

    out_json = tmp_path / "estimate.json"
    status = main(
        [
            "estimate",
            "tests/helpers/lightning_gpt.py:TinyGPT",
            "--datamodule",
            "tests/helpers/lightning_gpt.py:CharDataModule",
            "--datamodule-args",
            '{"batch_size": 12}',
            "--device",
            "cpu",
            "--device-memory",
            "64MiB",
            "--modes",
            "baseline,bf16",
            "--json",
            str(out_json),
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    data = json.loads(out_json.read_text())
    measured = {
        mode: measure_training_step(TinyGPT(), datamodule=CharDataModule(batch_size=12), mode=mode).peak_bytes
        for mode in ("baseline", "bf16")
    }
    for result in data["results"]:
        assert result["estimate"]["batch_size"] == 12
        assert result["estimate"]["peak_bytes"] == measured[result["mode"]], result["mode"]
        # the largest batch's predicted need is within the memory the table says it fits
        assert result["max_batch"]["predicted_bytes"] <= 0.95 * 64 * 2**20
    header = captured.out.splitlines()[1]
    assert "per sample" not in header and "needs at max" in header


def test_estimate_without_a_loader_points_at_datamodule_and_a_negative_memory_is_one_line(capsys):
    assert main(["estimate", "tests/helpers/lightning_gpt.py:TinyGPT", "--device-memory", "16GiB"]) == 2
    err = capsys.readouterr().err
    # what docs/worst_batch.md says the estimate does with the loader: its samples sized, the largest batch they make
    assert "--datamodule FILE.py:DataModuleClass" in err
    assert "sizes the samples of its train dataloader and estimates the largest batch they make at --batch-size" in err
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "-16GiB"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "memkit estimate: --device-memory -16GiB: a memory size is positive; write e.g. --device-memory 16GiB"
    )
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "0"]) == 2
    assert "a memory size is positive" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ --strategy
#: an MLP whose model states outweigh its activations at batch 2, so sharding decides how many GPUs it needs
WIDE = {"hidden": 1024, "depth": 4, "batch_size": 2}


def test_strategy_table_per_strategy_and_mode_and_the_fewest_gpus_that_fit(tmp_path, capsys):
    """Rows per strategy x mode at --world-size, each figure the library's per-rank estimate; "min GPUs" is the
    first of 1, 2, 4, ... whose per-rank peak fits, and a strategy that never fits (DDP: every rank holds
    everything) says so."""
    import math

    import torch

    from lightning_memkit.estimate import reusing_fake_copies
    from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
    from lightning_memkit.zoo import DemoMLP

    module = DemoMLP(**WIDE)
    strategies, sizes = ("ddp", "fsdp", "deepspeed_stage_2"), (1, 2, 4, 8, 16)
    with reusing_fake_copies():
        needs = {
            (s, n): estimate_distributed_memory(
                module, strategy=s, world_size=n, wrap={torch.nn.Linear}, device="cpu"
            ).peak_bytes
            for s in strategies
            for n in sizes
        }
    # a device where FSDP fits on 4 ranks but not on 2
    memory = math.ceil(needs[("fsdp", 4)] / 0.95) + 1
    assert needs[("fsdp", 2)] > 0.95 * memory
    out_json = tmp_path / "ranks.json"
    status = main(
        [
            "estimate",
            "lightning_memkit/zoo.py:DemoMLP",
            "--init-args",
            json.dumps(WIDE),
            "--device",
            "cpu",
            "--strategy",
            ",".join(strategies),
            "--world-size",
            "8",
            "--max-world-size",
            "16",
            "--wrap",
            "Linear",
            "--device-memory",
            f"{memory}B",
            "--modes",
            "baseline,bf16",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    header, rows = _table(out, "strategy")
    assert header == [
        "strategy",
        "mode",
        "ranks",
        "batch/rank",
        "allocated/rank",
        "reserved/rank",
        "device needs/rank",
        "fits",
        "min GPUs",
    ]
    assert set(rows) == {(s, m) for s in strategies for m in ("baseline", "bf16")}
    for strategy in strategies:
        row = rows[(strategy, "baseline")]
        expected_min = next((n for n in sizes if needs[(strategy, n)] <= 0.95 * memory), None)
        assert row[2:] == [
            "8",
            "2",
            format_bytes(needs[(strategy, 8)]),
            "-",
            format_bytes(needs[(strategy, 8)]),
            "yes" if needs[(strategy, 8)] <= 0.95 * memory else "no",
            str(expected_min) if expected_min else "none <= 16",
        ]
    assert rows[("fsdp", "baseline")][-1] == "4" and rows[("ddp", "baseline")][-1] == "none <= 16"
    assert "ddp baseline: none fits on up to 16 GPUs" in out
    data = json.loads(out_json.read_text())
    assert data["world_sizes_tried"] == list(sizes)
    fsdp = next(r for r in data["results"] if r["strategy"] == "fsdp" and r["mode"] == "baseline")
    assert fsdp["per_rank"]["allocated_bytes"] == needs[("fsdp", 8)] and fsdp["min_world_size"] == 4
    # FSDP's fewest by bisection from --world-size's answer (8 fits, 2 does not, 4 does): 1 is never estimated
    assert {int(n): v for n, v in fsdp["device_bytes_by_world_size"].items()} == {
        n: needs[("fsdp", n)] for n in (2, 4, 8)
    }


def test_fsdp_without_wrap_that_fits_on_no_size_names_its_one_unit_and_the_blocks_to_wrap(tmp_path, capsys):
    """FSDP without --wrap (and no configure_model) is one unit: every parameter is gathered at once on any number of
    ranks. Where no size fits, the answer says so and names the module's repeated blocks to give as --wrap; with
    --wrap that sentence is gone. The fewest GPUs took a bisection: the sizes estimated are fewer than those tried."""
    two_blocks = json.dumps({**TINY, "layers": 2})
    arguments = ["estimate", "lightning_memkit/zoo.py:DemoTransformer", "--init-args", two_blocks]
    arguments += ["--device", "cpu", "--strategy", "fsdp", "--world-size", "2", "--max-world-size", "64"]
    out_json = tmp_path / "ranks.json"
    assert main([*arguments, "--device-memory", "64KiB", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "fsdp baseline: none fits on up to 64 GPUs" in out
    assert "(what fsdp does not divide: the whole model gathered at once, one FSDP unit without --wrap; " in out
    assert "--wrap TransformerEncoderLayer (FSDP's units, its auto_wrap_policy), a smaller --batch-size" in out
    (result,) = json.loads(out_json.read_text())["results"]
    estimated = sorted(int(n) for n in result["device_bytes_by_world_size"])
    assert estimated[-1] == 64 and len(estimated) < 6, estimated  # 2 (the row), then 16 and 64 by bisection
    assert main([*arguments, "--device-memory", "64KiB", "--wrap", "TransformerEncoderLayer"]) == 0
    assert "one FSDP unit" not in capsys.readouterr().out


def test_strategy_that_does_not_fit_gets_the_modes_that_need_less_per_rank_with_their_fewest_gpus(tmp_path, capsys):
    """DDP of a transformer whose activations dominate: the mode asked for does not fit on 2 GPUs; each other mode's
    rank is estimated, and those that need less are printed with their figures and fewest GPUs, least first."""
    from lightning_memkit.estimate import reusing_fake_copies
    from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
    from lightning_memkit.estimate.mode_needs import ALTERNATIVE_MODES
    from lightning_memkit.zoo import DemoTransformer

    arguments = {**TINY, "layers": 3, "seq_len": 256, "batch_size": 16}
    module = DemoTransformer(**arguments)
    modes = ALTERNATIVE_MODES  # the ask (baseline) first
    with reusing_fake_copies():
        needs = {
            (mode, n): estimate_distributed_memory(module, strategy="ddp", world_size=n, mode=mode, device="cpu")
            for mode in modes
            for n in (1, 2, 4)
        }
    needs = {key: estimate.peak_bytes for key, estimate in needs.items()}
    memory = 60 * 2**20
    usable = 0.95 * memory
    assert needs[("baseline", 2)] > needs[("bf16", 2)] > usable > needs[("checkpoint", 2)]  # what this test is about
    out_json = tmp_path / "ranks.json"
    command = ["estimate", "lightning_memkit/zoo.py:DemoTransformer", "--init-args", json.dumps(arguments)]
    command += ["--device", "cpu", "--strategy", "ddp", "--world-size", "2", "--max-world-size", "4"]
    status = main([*command, "--device-memory", f"{memory}B", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert status == 0  # with --strategy, not fitting is an answer (the fewest GPUs), not a failure
    less = sorted((m for m in modes[1:] if needs[(m, 2)] < needs[("baseline", 2)]), key=lambda m: needs[(m, 2)])
    fewest = {m: next((n for n in (1, 2, 4) if needs[(m, n)] <= usable), None) for m in less}
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("ddp baseline: try")]
    assert lines == [
        f"ddp baseline: try --modes {m}: one rank needs {format_bytes(needs[(m, 2)])} on 2 GPUs "
        f"({'fits' if needs[(m, 2)] <= usable else 'does not fit'}); min GPUs {fewest[m] or 'none <= 4'}"
        for m in less
    ]
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["suggestions"] == [
        {
            "mode": m,
            "device_bytes_per_rank": needs[(m, 2)],
            "fits": needs[(m, 2)] <= usable,
            "min_world_size": fewest[m],
        }
        for m in less
    ]


def test_strategy_on_a_cuda_target_prints_reserved_per_rank(tmp_path, capsys):
    """On a CUDA target a rank's allocated and reserved figures are the rank's own caching allocator (replayed from its
    own step: the shards, FSDP's gathers and frees), and the device needs add the CUDA context."""
    import torch

    from lightning_memkit.estimate.distributed.per_rank import estimate_distributed_memory
    from lightning_memkit.zoo import DemoMLP

    out_json = tmp_path / "ranks.json"
    status = main(
        [
            "estimate",
            "lightning_memkit/zoo.py:DemoMLP",
            "--init-args",
            json.dumps(WIDE),
            "--strategy",
            "fsdp",
            "--world-size",
            "4",
            "--wrap",
            "Linear",
            "--device-memory",
            "1GiB",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    estimate = estimate_distributed_memory(
        DemoMLP(**WIDE), strategy="fsdp", world_size=4, wrap={torch.nn.Linear}, device="cuda"
    )
    view = estimate.cuda
    assert view is estimate.single.cuda and view.peak_allocated_bytes >= estimate.peak_bytes
    allocated, reserved = view.peak_allocated_bytes, view.peak_reserved_bytes
    _, rows = _table(out, "strategy")
    assert rows[("fsdp", "baseline")][4:7] == [
        format_bytes(allocated),
        format_bytes(reserved),
        format_bytes(reserved + view.context_bytes),
    ]
    result = json.loads(out_json.read_text())["results"][0]
    assert result["per_rank"] == {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "device_bytes": reserved + view.context_bytes,
    }
    assert result["estimate"]["peak_bytes"] == estimate.peak_bytes
    assert any(line.startswith("kernels assumed (fsdp baseline): GPU ") for line in out.splitlines())


def test_strategy_gpu_and_check_refusals_are_one_line_each(capsys):
    import torch

    from lightning_memkit.estimate.distributed.sharding import STRATEGIES

    base = ["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "1GiB"]
    cases = [
        (["--strategy", "ddp,zero9"], f"--strategy zero9: unknown strategy; choose from: {', '.join(STRATEGIES)}"),
        (["--strategy", "fsdp", "--world-size", "0"], "--world-size 0: the number of ranks is at least 1"),
        (["--world-size", "8"], "--world-size is for multi-GPU estimates: give --strategy too"),
        (
            ["--strategy", "fsdp", "--wrap", "Block"],
            "--wrap Block: DemoMLP has no layer of that class; its layer classes are: ",
        ),
        (["--gpu", "h1000"], "--gpu: unknown GPU 'h1000': give a name ("),
        (["--gpu", "a100", "--device", "cpu"], "--gpu a100 picks CUDA kernels; it needs --device cuda"),
        (
            ["--check", "--device", "cpu"],
            "--check measures a real step on a GPU against a CUDA estimate; use --device cuda",
        ),
        (["--check", "--strategy", "ddp"], "--check trains on this machine's one GPU; it does not run --strategy"),
        (["--check", "--meta-init"], "--check trains real steps, and a module built with --meta-init has no weights"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--check"], "--check trains two real steps on a GPU, and torch sees none here"))
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("memkit estimate: " + message), (extra, err)


def test_meta_init_estimates_what_the_module_with_weights_estimates(tmp_path, capsys):
    """--meta-init builds the module without weights (for models larger than the machine): same figures."""
    results = []
    for extra in ([], ["--meta-init"]):
        out_json = tmp_path / f"ranks{len(extra)}.json"
        assert (
            main(
                [
                    "estimate",
                    "lightning_memkit/zoo.py:DemoMLP",
                    "--init-args",
                    json.dumps(WIDE),
                    "--strategy",
                    "fsdp",
                    "--world-size",
                    "2",
                    "--device-memory",
                    "1GiB",
                    "--json",
                    str(out_json),
                ]
                + extra
            )
            == 0
        )
        capsys.readouterr()
        results.append(json.loads(out_json.read_text())["results"][0])
    for result in results:
        result["estimate"]["elapsed_s"] = result["estimate"]["single"]["elapsed_s"] = 0.0
    assert results[0] == results[1]


# ------------------------------------------------------------------------------------------ CLI syntax and exit codes
def test_a_bare_device_memory_number_is_refused_naming_the_unit_to_write(capsys):
    # '16' read as bytes answered "does not fit in 15 B": a device's memory is never a handful of bytes
    assert main(["estimate", "lightning_memkit/zoo.py:DemoMLP", "--device-memory", "16", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "memkit estimate: --device-memory 16 has no unit; write --device-memory 16GiB (or 16GB, decimal; "
        "a byte count as 16B)"
    )
    assert (
        main(
            [
                "estimate",
                "lightning_memkit/zoo.py:DemoMLP",
                "--device-memory",
                "16",
                "--device",
                "cpu",
                "--modes",
                "bf16",
            ]
        )
        == 2
    )


def test_a_mode_that_fails_makes_the_command_fail_and_the_fix_is_in_cli_syntax(capsys):
    from lightning_memkit.zoo import DemoTransformer

    needs = {
        mode: estimate_memory(DemoTransformer(**TINY), 1, mode=mode, device="cpu").required_bytes
        for mode in ("baseline", "bf16")
    }
    small, large = sorted(needs, key=needs.get)
    assert needs[small] < needs[large]  # bf16 autocast on CPU keeps bf16 weight copies beside the fp32 ones
    memory = (needs[small] + needs[large]) // 2  # batch 1 fits in one mode, not in the other
    status = main(
        [
            "estimate",
            "lightning_memkit/zoo.py:DemoTransformer",
            "--init-args",
            json.dumps(TINY),
            "--device-memory",
            f"{memory}B",
            "--device",
            "cpu",
            "--modes",
            "baseline,bf16",
            "--margin",
            "0",
        ]
    )
    captured = capsys.readouterr()
    assert status == 1  # one requested mode does not fit: the command fails, with every figure of both printed
    _, rows = _table(captured.out, "mode")
    assert rows[(small,)][6] == "1"  # max batch 1
    large_estimate = estimate_memory(DemoTransformer(**TINY), mode=large, device="cpu")
    assert rows[(large,)][1:] == [
        "4",
        format_bytes(large_estimate.peak_bytes),
        "-",
        format_bytes(large_estimate.required_bytes),
        format_bytes(needs[large]),
        "does not fit",
        "-",
    ]
    assert f"{large}: tensor bytes at the peak (batch 4," in captured.out
    (line,) = [line for line in captured.err.splitlines() if line.startswith(f"memkit estimate: mode {large}:")]
    assert f"it needs {format_bytes(needs[large])}" in line and "mode=" not in line and "'" not in line
    # the fix is computed: the other mode, estimated at batch 1, needs less and fits; the command's syntax names it
    assert f"try --modes {small}: needs {format_bytes(needs[small])} at batch size 1" in captured.out
    assert f"try --modes {large}:" not in captured.out


def test_the_search_summary_says_no_prediction_rather_than_none():
    from lightning_memkit.search.batch_search import SearchResult, Trial

    result = SearchResult(batch_size=8, trials=[Trial(8, True, 1024, 0.5)], reason="max_val")
    assert "None" not in result.table() and "no prediction" in result.table().splitlines()[0]
    assert "predicted 12," in SearchResult(batch_size=8, predicted=12, reason="converged").table()


#: what estimating a step needs none of: training callbacks, the planner, the batch-size search, the doctor, the
#: layer trace, the report, the TensorBoard dashboard, the mode comparison
NOT_FOR_AN_ESTIMATE = ("callbacks", "plan", "search", "doctor", "trace", "report", "tensorboard", "modes.comparison")


def test_memkit_estimate_imports_what_estimating_needs_and_nothing_else():
    """A fresh process runs ``memkit estimate --help`` (the estimate command's module and parser) and reads back the
    memkit modules it loaded: the estimate's, none of the other commands'."""
    code = (
        "import sys\nfrom lightning_memkit.cli import main\ntry:\n    main(['estimate', '--help'])\n"
        "except SystemExit:\n    pass\n"
        "print('MODULES', *sorted(m for m in sys.modules if m.startswith('lightning_memkit')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    loaded = run.stdout.split("MODULES", 1)[1].split()
    assert "usage: memkit estimate" in run.stdout
    assert {"lightning_memkit.cli.estimate", "lightning_memkit.estimate.step.runner"} <= set(loaded)
    unneeded = [m for m in loaded if any(m.startswith(f"lightning_memkit.{part}") for part in NOT_FOR_AN_ESTIMATE)]
    assert not unneeded, f"memkit estimate imports modules it does not use: {unneeded}"
