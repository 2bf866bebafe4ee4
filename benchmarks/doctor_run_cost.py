"""The memory doctor's whole-run cost with a leak, before and after holder search, side by side.

A real ``Trainer.fit`` of 24 steps with ``MemoryDoctor`` on a small MLP whose outputs leak, in two
shapes: held by the model (``model.kept``: a root reaches it, the search stops as soon as it finds it)
and held only by a global forward hook registered with torch (no root the user knows reaches it: the
search walks all the roots reach, then gives up). Each run is its own process, timed with the process's
CPU time around ``trainer.fit`` alone (imports excluded); the code "before" is a git revision of the
package (default ``main``) exported to a temporary directory, "after" is this checkout. Runs are
interleaved round-robin; the figure is the median over rounds.

    python benchmarks/doctor_run_cost.py                  # about 2 minutes on 2 cores
    python benchmarks/doctor_run_cost.py --rounds 2       # quicker
    python benchmarks/doctor_run_cost.py --before DIR     # "before" from a directory holding lightning_memkit/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(shape: str) -> None:
    import time
    import warnings

    warnings.simplefilter("ignore")
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memkit.callbacks.memory_doctor import MemoryDoctor

    torch.manual_seed(0)
    torch.set_num_threads(1)
    hooked: list = []

    class Leaky(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                *[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())], nn.Linear(256, 10)
            )
            self.kept = []
            self.x, self.y = torch.randn(64 * 64, 256), torch.randn(64 * 64, 10)

        def training_step(self, batch, batch_idx):
            out = self.net(batch[0])
            if shape == "root":
                self.kept.append(out.detach())
            return F.mse_loss(out, batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters())

        def train_dataloader(self):
            return DataLoader(TensorDataset(self.x, self.y), batch_size=64)

    handle = None
    if shape == "no-root":

        def keep(module, args, output):  # held by torch's global hooks dict and this closure's list only
            if isinstance(module, nn.Sequential):
                hooked.append(output.detach())

        handle = torch.nn.modules.module.register_module_forward_hook(keep)
    doctor = MemoryDoctor(verbose=False)
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            max_steps=24,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=[doctor],
            accelerator="cpu",
            devices=1,
        )
        module = Leaky()
        start = time.process_time()
        trainer.fit(module)
        seconds = time.process_time() - start
    if handle is not None:
        handle.remove()
    search = getattr(doctor, "holder_search", None)
    leak = doctor.report.leak
    print(
        json.dumps(
            {
                "cpu_s": seconds,
                "leak": leak.bytes_per_step if leak else None,
                "holder": (
                    leak.growing[0].holder if leak and leak.growing and hasattr(leak.growing[0], "holder") else None
                ),
                "search_s": search.seconds if search else None,
                "stopped": search.stopped if search else None,
                "objects": search.objects if search else None,
            }
        )
    )


def export(ref: str) -> str:
    directory = tempfile.mkdtemp(prefix="memkit_before_")
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", ref, "lightning_memkit"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ref",
        default=None,
        help="git revision of the code before (default: where this branch left main; "
        "once main has merged it, give the commit before, e.g. --ref c35829c)",
    )
    parser.add_argument("--before", default=None, help="a directory holding the package before (instead of --ref)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    ref = (
        args.ref
        or subprocess.run(
            ["git", "-C", ROOT, "merge-base", "HEAD", "main"], check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    before = args.before or export(ref)
    print(f"before: {args.before or ref}, after: {ROOT} (working tree)")
    codes = {"before": before, "after": ROOT}
    results: dict[tuple, list] = {}
    extra: dict[tuple, dict] = {}
    for _ in range(args.rounds):
        for shape in ("root", "no-root"):
            for code, path in codes.items():
                env = dict(os.environ, PYTHONPATH=path)
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--worker", shape],
                    env=env,
                    cwd=tempfile.gettempdir(),
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if out.returncode:
                    raise SystemExit(out.stderr[-3000:])
                data = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((shape, code), []).append(data["cpu_s"])
                extra[(shape, code)] = data
    print(f"{'leak held by':<14}{'code':<8}{'CPU s/fit':>10}{'ratio':>8}  holder search")
    for shape in ("root", "no-root"):
        base = statistics.median(results[(shape, "before")])
        for code in codes:
            median = statistics.median(results[(shape, code)])
            data = extra[(shape, code)]
            search = (
                "-"
                if data["search_s"] is None
                else f"{data['search_s'] * 1e3:.0f} ms ({data['stopped']}): {data['holder'] or 'no holder'}"
            )
            print(f"{shape:<14}{code:<8}{median:>10.3f}{median / base:>8.3f}  {search}")


if __name__ == "__main__":
    main()
