"""`hpcbert` command line: parses options into RunConfig and dispatches. Nothing else lives here.

    hpcbert train  [options]           one training run (under torchrun for several processes)
    hpcbert bench  [options]           one short time-boxed run per checkpointing policy + table
    hpcbert plan --memory 40GiB [opts] the largest batch per checkpointing policy, and the fastest
    hpcbert report RUN_DIR... [opts]   tables and an HTML report from run directories
    hpcbert submit [opts] -- [train]   render a PBS Pro / Torque / Slurm job script and submit it
    hpcbert prepare-pretraining IN...  raw text -> sharded token arrays for masked-LM pre-training
    hpcbert export RUN_DIR --out DIR   a run's model as a Hugging Face directory
"""

from __future__ import annotations

import argparse
import os
import sys

from . import config, cuda_allocator_default


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cuda_allocator_default()  # before torch is imported: hpcbert's CUDA runs use expandable segments
    if argv and argv[0] == "report":
        from . import report
        return report.cli(argv[1:])
    if argv and argv[0] == "submit":
        from .jobs import submit
        return submit.cli(argv[1:])
    if argv and argv[0] == "prepare-pretraining":
        from .data import pretrain
        return pretrain.cli(argv[1:])
    if argv and argv[0] == "plan":  # torch imported inside, only when planning
        from . import plan
        return plan.cli(argv[1:])
    if argv and argv[0] == "export":
        from . import export
        return export.cli(argv[1:])

    parser = argparse.ArgumentParser(prog="hpcbert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="one training run")
    config.add_arguments(p_train)
    p_bench = sub.add_parser("bench", help="one short time-boxed run per checkpointing policy, then a table")
    from . import bench
    bench.add_options(p_bench)
    sub.add_parser("report", help="tables and an HTML report from run directories (see hpcbert report --help)")
    sub.add_parser("submit", help="render a PBS Pro / Torque / Slurm job script and submit it (see hpcbert submit --help)")
    sub.add_parser("prepare-pretraining", help="raw text -> sharded token arrays (see hpcbert prepare-pretraining --help)")
    sub.add_parser("plan", help="the largest batch per checkpointing policy and the fastest (see hpcbert plan --help)")
    sub.add_parser("export", help="a run's model as a Hugging Face directory (see hpcbert export --help)")

    ns = parser.parse_args(argv)
    from .dist import StartupError  # torch is imported here, not for report / submit / prepare-pretraining

    try:
        if ns.command == "train":
            from .train import train
            train(config.from_namespace(ns))
            return 0
        if ns.command == "bench":
            return bench.run(ns)
    except (ValueError, FileNotFoundError) as e:  # user errors (CheckpointError too): what to fix, no traceback
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
