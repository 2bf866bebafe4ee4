"""Every public callback's arguments are checked when it is built, as docs/arguments.md lists them.

The table in docs/arguments.md is the data: each row's wrong-type and wrong-value examples are built
here and must be refused at construction with a message naming the argument and the accepted form
(the table's text), and every argument of every public callback must have a row. LightningCLI
(jsonargparse) refuses them too, from a YAML config and from the command line, and a YAML config's
class paths train with those blocks checkpointed.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_memkit
from lightning_memkit import ActivationCheckpointing, LayerTrace, MaxBatchSize, MemoryDoctor, MemoryTracker
from lightning_memkit.callbacks.activation_offload import ActivationOffload
from lightning_memkit.callbacks.auto_fit import AutoFit
from tests.helpers.paths import REPO_ROOT

DOC = os.path.join(REPO_ROOT, "docs", "arguments.md")
CALLBACKS = {
    c.__name__: c
    for c in (
        MemoryTracker,
        LayerTrace,
        MaxBatchSize,
        ActivationCheckpointing,
        MemoryDoctor,
        AutoFit,
        ActivationOffload,
    )
}


def _table() -> list[tuple[str, str, str, str, str]]:
    with open(DOC) as file:
        text = file.read()
    body = text.split("<!-- arguments-table -->")[1].split("<!-- /arguments-table -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, line
        rows.append(tuple(cells))
    return rows


ROWS = _table()


def _cases():
    for owner, name, accepted, wrong_type, wrong_value in ROWS:
        for kind, example in (("type", wrong_type), ("value", wrong_value)):
            if example != "—":
                yield pytest.param(
                    owner, name, accepted, ast.literal_eval(example.strip("`")), id=f"{owner}-{name}-{kind}"
                )


def test_every_public_callback_is_in_the_table_with_every_argument():
    public = {
        name
        for name in lightning_memkit.__all__
        if isinstance(getattr(lightning_memkit, name), type)
        and issubclass(getattr(lightning_memkit, name), __import__("lightning").pytorch.Callback)
    }
    assert public == set(CALLBACKS)
    for owner, callback in CALLBACKS.items():
        arguments = [n for n in inspect.signature(callback.__init__).parameters if n != "self"]
        documented = [name for o, name, *_ in ROWS if o == owner]
        assert documented == arguments, owner


@pytest.mark.parametrize(("owner", "name", "accepted", "value"), list(_cases()))
def test_a_wrong_argument_is_refused_when_the_callback_is_built(owner, name, accepted, value):
    with pytest.raises(MisconfigurationException) as caught:
        CALLBACKS[owner](**{name: value})
    message = str(caught.value)
    assert message.startswith(f"{owner}(") and f"{name}=" in message, message
    assert accepted in message, message


def test_steps_given_as_text_are_one_step_and_defaults_are_accepted():
    assert LayerTrace(at_steps="12").at_steps == frozenset({12})
    assert LayerTrace(at_steps=["3", 5]).at_steps == frozenset({3, 5})
    assert LayerTrace(at_steps=7).at_steps == frozenset({7})
    for bad in ("1,2", "twelve", [1.0], True, [True]):
        with pytest.raises(MisconfigurationException, match=r"LayerTrace\(at_steps="):
            LayerTrace(at_steps=bad)
    for callback in CALLBACKS.values():
        callback()  # every default passes its own checks


def test_class_paths_are_resolved_for_policy_and_module_filters():
    checkpointing = ActivationCheckpointing(policy=["torch.nn.TransformerEncoderLayer"], measure=False)
    assert checkpointing.policy == frozenset({torch.nn.TransformerEncoderLayer})
    assert ActivationCheckpointing(policy="torch.nn.Linear").policy == frozenset({torch.nn.Linear})
    trace = LayerTrace(modules=["torch.nn.Linear", "encoder.layers.*", "net.0"])
    assert trace.modules == (torch.nn.Linear, "encoder.layers.*", "net.0")
    with pytest.raises(MisconfigurationException, match="no package 'no_such_package' is installed"):
        ActivationCheckpointing(policy=["no_such_package.Block"])
    with pytest.raises(MisconfigurationException, match="has no class 'NoSuchLayer'"):
        ActivationCheckpointing(policy=["torch.nn.NoSuchLayer"])
    with pytest.raises(MisconfigurationException, match="LayerTrace\\(modules="):
        LayerTrace(modules=["torch.optim.Adam"])  # a class, not a module class


# ------------------------------------------------------------------------------------ LightningCLI
CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  default_root_dir: {root}
  callbacks:
{callbacks}
model:
  class_path: lightning_memkit.zoo.DemoTransformer
  init_args:
    vocab_size: 50
    d_model: 32
    nhead: 2
    layers: 2
    dim_feedforward: 64
    seq_len: 16
    dropout: 0.0
data:
  class_path: lightning_memkit.zoo.SyntheticDataModule
  init_args:
    batch_size: 4
    train_size: 16
    val_size: 4
    input_shape: [16]
    vocab_size: 50
"""


def _cli(tmp_path, callbacks: str, argv=(), run=False):
    from lightning.pytorch.cli import LightningCLI

    path = tmp_path / "config.yaml"
    path.write_text(CONFIG.format(root=tmp_path, callbacks=textwrap.indent(textwrap.dedent(callbacks).strip(), "    ")))
    args = [f"--config={path}", *argv]
    if run:
        args = ["fit", *args]
    return LightningCLI(args=args, run=run, save_config_callback=None)


@pytest.mark.parametrize(
    ("callbacks", "argv", "expected"),
    [
        ("- class_path: lightning_memkit.LayerTrace\n  init_args:\n    at_steps: [1.5]", (), "at_steps"),
        ("- class_path: lightning_memkit.MemoryTracker\n  init_args:\n    per_rank: maybe", (), "per_rank"),
        ("- class_path: lightning_memkit.MaxBatchSize\n  init_args:\n    max_trials: 2.5", (), "max_trials"),
        ("- class_path: lightning_memkit.LayerTrace\n  init_args:\n    max_results: 0", (), "max_results"),
        (
            "- class_path: lightning_memkit.ActivationCheckpointing\n  init_args:\n    policy: [torch.nn.NoSuchLayer]",
            (),
            "NoSuchLayer",
        ),
        ("- class_path: lightning_memkit.MemoryTracker", ("--trainer.callbacks.every_n_steps=1.5",), "every_n_steps"),
    ],
    ids=["yaml-float-steps", "yaml-bool", "yaml-float-count", "yaml-value", "yaml-class-path", "argv-float"],
)
def test_lightning_cli_refuses_them_from_yaml_and_the_command_line(tmp_path, capsys, callbacks, argv, expected):
    # a wrong type stops jsonargparse's parsing (SystemExit, its message on stderr); a wrong value stops the
    # callback's constructor, which jsonargparse reports as a ValueError holding memkit's message
    with pytest.raises((SystemExit, MisconfigurationException, ValueError)) as caught:
        _cli(tmp_path, callbacks, argv)
    said = str(caught.value) + capsys.readouterr().err
    assert expected in said, said


def test_a_yaml_config_with_a_class_path_policy_trains_with_those_blocks_checkpointed(tmp_path):
    from lightning_memkit.modes.checkpoint_wrap import is_checkpointed

    class Seen:  # which TransformerEncoderLayers were checkpointed while training
        wrapped: list[bool] = []

    callbacks = """
    - class_path: lightning_memkit.ActivationCheckpointing
      init_args:
        policy: [torch.nn.TransformerEncoderLayer]
        verbose: false
    - class_path: lightning_memkit.LayerTrace
      init_args:
        at_steps: "1"
        modules: [torch.nn.TransformerEncoderLayer]
        verbose: false
    """
    cli = _cli(tmp_path, callbacks, run=False)
    import lightning.pytorch as pl

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            Seen.wrapped.append(
                [is_checkpointed(m) for m in module.modules() if isinstance(m, torch.nn.TransformerEncoderLayer)]
            )

    cli.trainer.callbacks.append(Watch())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    checkpointing = next(c for c in cli.trainer.callbacks if isinstance(c, ActivationCheckpointing))
    trace = next(c for c in cli.trainer.callbacks if isinstance(c, LayerTrace))
    assert checkpointing.policy == frozenset({torch.nn.TransformerEncoderLayer})
    assert checkpointing.plan is not None and checkpointing.plan.count == 2
    assert Seen.wrapped == [[True, True], [True, True]]
    assert trace.modules == (torch.nn.TransformerEncoderLayer,) and trace.at_steps == frozenset({1})
    assert [r.step for r in trace.results] == [1]
