"""``python -m cbpause.apps.scenarios [--real] [--count N] [--seed S]``: record scenarios, validate every trace.

Without ``--real``: ``--count`` (default 200) random threaded scenarios of simulated ranks.  With ``--real``:
``--count`` (default 60) scenarios on transformers' real loop, of which the first ``--tp`` (default: every TP=2
plan) run at TP=2 in two processes.  ``--seed S`` reproduces a run's plans.  ``--real --plans 'kill_*' --repeat
20`` runs only the TP=2 plans that match (a shell pattern), each 20 times, and ends with one line per plan
(``kill_body: runs=20 validated=20 lost=0 duplicated=0 problems=0``).
"""

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cbpause.apps.scenarios", description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="scenarios on transformers' real loop")
    parser.add_argument("--count", type=int, default=None)
    parser.add_argument("--tp", type=int, default=None, help="TP=2 scenarios among them (--real; default: every plan)")
    parser.add_argument("--plans", default=None, help="--real: run only the TP=2 plans matching this shell pattern")
    parser.add_argument("--repeat", type=int, default=1, help="--real --plans: how many times each plan runs")
    parser.add_argument("--covering", action="store_true",
                        help="--real: only the covering subset (a few TP=2 plans and single-rank scenarios that take "
                             "every action of the spec; what CI runs)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--record", type=Path, default=None,
                        help="--real: write the run's command, commit, date, coverage and closing line to this file "
                             "(docs/measured/real-campaign.txt is what docs/verification.md shows)")  # fmt: skip
    parser.add_argument("--tla-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.covering and (args.plans is not None or args.count is not None or args.tp is not None):
        parser.error("--covering runs a fixed subset: --plans, --count and --tp do not go with it")
    if args.record is not None and (args.covering or args.plans is not None):
        parser.error("--record writes a campaign's record: not with --covering or --plans")
    if args.repeat > 1 and args.plans is None:
        parser.error("--repeat goes with --plans")
    if args.count is None:
        args.count = 60 if args.real else 200
    if args.count < 1:
        parser.error("--count must be >= 1")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if (args.plans is not None or args.repeat > 1 or args.record is not None or args.covering) and not args.real:
        parser.error("--plans, --repeat, --record and --covering go with --real")
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
