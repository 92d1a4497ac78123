"""`hpcbert` command line: parses options into RunConfig and dispatches. Nothing else lives here.

    hpcbert train  [options]           one training run (under torchrun for several processes)
    hpcbert bench  [options]           one short time-boxed run per checkpointing policy + table
    hpcbert report RUN_DIR... [opts]   tables and an HTML report from run directories
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing

from .config import RunConfig, field_help
from .dist import StartupError


def _base_type(tp):
    """int | None -> int, etc."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under `from __future__ import annotations`
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def add_run_options(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One --option per RunConfig field, help text from the field's docstring."""
    helps = field_help()
    defaults = defaults or {}
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        tp = _base_type(f.type)
        h = helps.get(f.name, "")
        if tp is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=h)
        elif f.name in ("time_budget", "checkpoint_every"):
            p.add_argument(flag, type=str, default=default, help=h)
        else:
            p.add_argument(flag, type=tp, default=default, help=f"{h} (default: {default})")


def config_from_args(ns: argparse.Namespace) -> RunConfig:
    return RunConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RunConfig)})


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        from . import report
        return report.cli(argv[1:])
    if argv and argv[0] == "submit":
        from .jobs import submit
        return submit.cli(argv[1:])

    parser = argparse.ArgumentParser(prog="hpcbert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="one training run", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_options(p_train)
    p_bench = sub.add_parser("bench", help="one short time-boxed run per checkpointing policy, then a table")
    from . import bench
    bench.add_options(p_bench)
    sub.add_parser("report", help="tables and an HTML report from run directories (see hpcbert report --help)")
    sub.add_parser("submit", help="render a PBS Pro / Torque / Slurm job script and submit it (see hpcbert submit --help)")

    ns = parser.parse_args(argv)
    try:
        if ns.command == "train":
            from .train import train
            train(config_from_args(ns))
            return 0
        if ns.command == "bench":
            return bench.run(ns)
    except (ValueError, FileNotFoundError) as e:  # user errors: say what to fix, no traceback
        if os.environ.get("HPCBERT_DEBUG"):
            raise
        print(f"hpcbert {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except StartupError as e:  # a rank did not arrive: the message names it
        print(f"hpcbert {ns.command}: error: {e}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    sys.exit(main())
