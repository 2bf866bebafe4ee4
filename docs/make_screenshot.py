"""Screenshot memkit's TensorBoard dashboard (Custom Scalars tab) for a real ``memkit demo`` run.

Not part of CI. Needs Debian's Chromium (``apt-get install -y chromium chromium-driver``; pass
``--install`` to have this script run apt-get). Usage::

    python docs/make_screenshot.py                     # writes docs/images/dashboard.png
    python docs/make_screenshot.py --out /tmp/d.png --steps 60 --model transformer
    python docs/make_screenshot.py --logdir gl --update-layout --out docs/images/dashboard_h100_demo.png

It runs ``memkit demo`` into a temporary log dir, serves it with ``tensorboard`` on 127.0.0.1
(a free port, never ``--bind_all``), opens ``/#custom_scalars`` in headless Chromium and
writes the PNG. Look at the PNG before committing it. ``--update-layout`` serves a copy of
``--logdir`` given today's layout (``update_dashboards``): logs written by an older memkit, e.g.
the shared H100 logs, as a user sees them after upgrading.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from lightning_memkit.tensorboard.server import TensorBoardServer

HERE = os.path.dirname(os.path.abspath(__file__))


def find_chromium() -> str | None:
    """The Chromium executable on PATH, if any."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(url: str, out: str, width: int, height: int, budget_ms: int, timeout_s: float) -> None:
    """Headless Chromium screenshot of ``url`` into ``out`` (PNG)."""
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("Chromium not found: run `apt-get install -y chromium chromium-driver` or pass --install")
    with tempfile.TemporaryDirectory(prefix="memkit-chromium-") as profile:
        command = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--screenshot={os.path.abspath(out)}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={budget_ms}",
            url,
        ]
        subprocess.run(command, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not os.path.exists(out):
        raise SystemExit(f"Chromium wrote no screenshot to {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "images", "dashboard.png"), help="PNG to write")
    parser.add_argument("--model", default="cnn", choices=("mlp", "cnn", "transformer"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--logdir", default=None, help="serve this log dir instead of running memkit demo")
    parser.add_argument(
        "--update-layout",
        action="store_true",
        help="serve a copy of --logdir with today's dashboard layout, built from its tags",
    )
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1200)
    parser.add_argument("--budget-ms", type=int, default=20000, help="Chromium --virtual-time-budget")
    parser.add_argument("--install", action="store_true", help="apt-get install chromium chromium-driver first")
    args = parser.parse_args(argv)
    if args.install and find_chromium() is None:
        subprocess.run(["apt-get", "install", "-y", "chromium", "chromium-driver"], check=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memkit-demo-") as tmp:
        logdir = args.logdir
        if logdir is None:
            logdir = os.path.join(tmp, "logs")
            memkit = os.path.join(os.path.dirname(sys.executable), "memkit")
            subprocess.run(
                [memkit, "demo", "--model", args.model, "--steps", str(args.steps), "--logdir", logdir],
                check=True,
                timeout=600,
            )
            # only the TensorBoard run (the demo also writes a CSVLogger run next to it)
        elif args.update_layout:
            from lightning_memkit.tensorboard.dashboard import update_dashboards

            copy = os.path.join(tmp, "logs")
            shutil.copytree(logdir, copy)
            logdir = copy
            for run_dir, layout in update_dashboards(logdir).items():
                print(f"{os.path.relpath(run_dir, logdir)}: {sum(len(c) for c in layout.values())} charts")
        with TensorBoardServer(logdir) as server:
            layout = server.get_json("/data/plugin/custom_scalars/layout")
            if not layout.get("category"):
                raise SystemExit(f"no memkit layout in {logdir}: was MemoryTracker with a TensorBoardLogger used?")
            screenshot(
                server.url + "/#custom_scalars", args.out, args.width, args.height, args.budget_ms, timeout_s=180
            )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
