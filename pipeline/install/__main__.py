"""python -m pipeline.install setup|bundle: what `make setup` and `make bundle` run (the Makefile passes DEVICE,
PYTHON, BUNDLE and the BUNDLE_* variables through)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.install import bundle, venv
from pipeline.install.stacks import CPU, GPU


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipeline.install")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="install the CPU or GPU stack into .venv")
    s.add_argument("--device", default="", help="cpu or gpu; unset: the stack .venv holds, else auto (a GPU here: gpu)")
    s.add_argument("--python", default="", help="an existing Python to build the venv on top of (its packages kept)")
    s.add_argument("--bundle", default="", help="a directory `make bundle` wrote: install from it, with no network")
    b = sub.add_parser("bundle", help="write the wheels of a stack for an offline host")
    b.add_argument("--device", default="gpu", choices=[CPU, GPU])
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--python-version", default=None, help="the host's CPython, e.g. 3.12 (default: this one's)")
    b.add_argument("--host-packages", type=Path, default=None,
                   help="the host's `python3 -m pip list --format=freeze`: what it holds is left out")
    b.add_argument("--cut-arch", type=int, default=None, help="e.g. 90: vLLM cut to that GPU generation's kernels")
    b.add_argument("--part-mib", type=int, default=60, help="with --cut-arch: parts of at most this many MiB")
    args = parser.parse_args(argv)
    if args.command == "bundle":
        bundle.write(args.device, args.out, args.python_version, args.host_packages, args.cut_arch, args.part_mib)
    else:
        venv.setup(args.device, args.python, Path(args.bundle) if args.bundle else None)


if __name__ == "__main__":
    main()
