"""``python -m cbpause.scenarios [--real] [--count N] [--seed S]``: record scenarios, validate every trace.

Without ``--real``: ``--count`` (default 200) random threaded scenarios of simulated ranks.  With ``--real``:
``--count`` (default 60) scenarios on transformers' real loop, of which the first ``--tp`` (default 12, every
TP=2 plan) run at TP=2 in two processes.  ``--seed S`` reproduces a run's plans.
"""

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cbpause.scenarios", description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="scenarios on transformers' real loop")
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--tp", type=int, default=12, help="TP=2 scenarios among them (--real; at most 12)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--tla-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.count is None:
        args.count = 60 if args.real else 200
    if args.count < 1:
        parser.error("--count must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real:
        from .real import main as real_main

        return real_main(args)
    from .group import main as group_main

    return group_main(args)


if __name__ == "__main__":
    sys.exit(main())
