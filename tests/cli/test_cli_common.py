"""What every memkit verb shares when it builds a user's classes: --init-args, --batch-size, errors."""

import pytest

from lightning_memkit.cli import main
from lightning_memkit.cli.common import CliError, build_instance, json_object


class TakesBatchSize:
    def __init__(self, width=4, batch_size=8):
        self.width, self.batch_size = width, batch_size


class HasAttribute:
    def __init__(self, width=4):
        self.width, self.batch_size = width, 8


class NoBatchSize:
    def __init__(self, width=4):
        self.width = width


def test_build_instance_passes_init_args_and_puts_the_batch_size_where_it_belongs():
    made = build_instance(TakesBatchSize, {"width": 7}, 32)
    assert (made.width, made.batch_size) == (7, 32)
    made = build_instance(HasAttribute, {"width": 5}, 16)
    assert (made.width, made.batch_size) == (5, 16)
    assert build_instance(NoBatchSize, {}).width == 4
    with pytest.raises(CliError, match="no batch_size argument or attribute"):
        build_instance(NoBatchSize, {}, 16)
    with pytest.raises(CliError, match="--init-args"):
        build_instance(NoBatchSize, {"depth": 3})
    with pytest.raises(CliError, match="not a class"):
        build_instance(len, {})


def test_json_object_explains_what_to_write():
    assert json_object('{"a": 1}', "--init-args") == {"a": 1}
    with pytest.raises(CliError, match="JSON object"):
        json_object("[1]", "--init-args")
    with pytest.raises(CliError, match="not JSON"):
        json_object("{a: 1}", "--init-args")


def test_estimate_builds_the_module_with_init_args(capsys):
    status = main(
        [
            "estimate",
            "lightning_memkit.zoo:DemoMLP",
            "--init-args",
            '{"depth": 1, "hidden": 32}',
            "--device",
            "cpu",
            "--device-memory",
            "1GiB",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "max batch" in out
    assert (
        main(["estimate", "lightning_memkit.zoo:DemoMLP", "--init-args", '{"dept": 1}', "--device-memory", "1GiB"]) == 2
    )
    assert "unexpected keyword argument 'dept'" in capsys.readouterr().err


def test_user_file_errors_and_wrong_classes_get_a_message_not_a_traceback(tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    missing = tmp_path / "needs_missing.py"
    missing.write_text("import memkit_no_such_package_xyz\n")
    plain = tmp_path / "plain.py"
    plain.write_text(
        "import torch\nimport lightning.pytorch as pl\n\nclass Plain(torch.nn.Module):\n    pass\n\n"
        "class NoData(pl.LightningModule):\n    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), 0.1)\n"
    )
    assert main(["trace", f"{broken}:X"]) == 2
    assert "broken.py, line 1" in capsys.readouterr().err
    assert main(["compare", f"{missing}:X"]) == 2
    assert "No module named 'memkit_no_such_package_xyz'; install" in capsys.readouterr().err
    assert main(["estimate", f"{plain}:Nope", "--device-memory", "1GiB"]) == 2
    assert "the classes it defines are: NoData, Plain" in capsys.readouterr().err
    assert main(["estimate", f"{plain}:Plain", "--device-memory", "1GiB"]) == 2
    assert "not a LightningModule class" in capsys.readouterr().err
    assert main(["estimate", f"{plain}:NoData", "--device-memory", "1GiB"]) == 2
    assert (
        "NoData defines no train_dataloader(); give the datamodule that feeds it with --datamodule"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["estimate", "lightning_memkit.zoo:DemoMLP", "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_settings_lightning_rejects_and_bad_sizes_get_a_message_not_a_traceback(tmp_path, capsys):
    assert main(["demo", "--accelerator", "tpuu", "--steps", "1", "--logdir", str(tmp_path)]) == 2
    assert "Lightning cannot train with --accelerator tpuu" in capsys.readouterr().err
    assert main(["trace", "lightning_memkit.zoo:DemoMLP", "--precision", "17"]) == 2
    assert "Precision '17' is invalid" in capsys.readouterr().err
    assert main(["compare", "lightning_memkit.zoo:DemoMLP", "--batch-size", "0", "--logdir", str(tmp_path)]) == 2
    assert "--batch-size 0: give a positive integer" in capsys.readouterr().err
    assert main(["compare", "lightning_memkit.zoo:DemoMLP", "--val-batches", "-1", "--logdir", str(tmp_path)]) == 2
    assert "--val-batches -1" in capsys.readouterr().err
    assert (
        main(
            [
                "compare",
                "lightning_memkit.zoo:DemoMLP",
                "--accelerator",
                "tpuu",
                "--steps",
                "1",
                "--modes",
                "baseline",
                "--no-figures",
                "--logdir",
                str(tmp_path),
            ]
        )
        == 1
    )
    assert "mode baseline failed: ValueError: You selected an invalid accelerator name" in capsys.readouterr().err


def test_an_output_path_that_cannot_be_written_is_a_message_not_a_traceback(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    status = main(
        [
            "estimate",
            "lightning_memkit.zoo:DemoMLP",
            "--init-args",
            '{"depth": 1, "hidden": 32}',
            "--device",
            "cpu",
            "--device-memory",
            "1GiB",
            "--json",
            str(blocker / "out.json"),
        ]
    )
    assert status == 1
    assert (
        f"{blocker / 'out.json'}: Not a directory; give a path in a directory you can write to"
        in capsys.readouterr().err
    )
    status = main(
        [
            "compare",
            "lightning_memkit.zoo:DemoMLP",
            "--steps",
            "1",
            "--modes",
            "baseline",
            "--logdir",
            str(blocker / "cmp"),
        ]
    )
    assert status == 1
    assert f"{blocker / 'cmp'}: Not a directory; give a path in a directory you can write to" in capsys.readouterr().err


def test_a_file_inside_a_package_is_imported_from_the_package_root(tmp_path, monkeypatch):
    import sys

    from lightning_memkit.cli.common import load_object

    monkeypatch.setattr(sys, "path", list(sys.path))
    package = tmp_path / "memkit_test_pkg_xyz"
    (package / "tensorboard").mkdir(parents=True)  # a subpackage named like a library must not shadow it
    (package / "__init__.py").write_text("")
    (package / "tensorboard" / "__init__.py").write_text("")
    (package / "data.py").write_text("SIZE = 3\n")
    (package / "model.py").write_text("from .data import SIZE\n\nclass Thing:\n    size = SIZE\n")
    try:
        thing = load_object(f"{package / 'model.py'}:Thing")
        assert thing.size == 3 and thing.__module__ == "memkit_test_pkg_xyz.model"
        assert str(package) not in sys.path and str(tmp_path) in sys.path
    finally:
        for name in [n for n in sys.modules if n.startswith("memkit_test_pkg_xyz")]:
            del sys.modules[name]


def test_estimate_prints_a_row_for_a_checkpoint_budget_mode(capsys):
    # DemoMLP's three blocks cannot meet half the baseline's activations: the mode gets its row (dashes), the
    # reason on stderr, and the command fails as for any mode that failed
    assert (
        main(
            [
                "estimate",
                "lightning_memkit.zoo:DemoMLP",
                "--device",
                "cpu",
                "--device-memory",
                "1GiB",
                "--modes",
                "baseline,checkpoint:budget=0.5",
            ]
        )
        == 1
    )
    captured = capsys.readouterr()
    rows = [line.split()[0] for line in captured.out.splitlines() if line.strip()]
    assert "baseline" in rows and "checkpoint:budget=0.5" in rows
    assert "budget" in captured.err and "cannot be met" in captured.err
