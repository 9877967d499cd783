"""The `mappa` command. Each subcommand is one entry in COMMANDS: its help, its arguments, and the function
that runs it (returns the exit status), so a new subcommand is one function pair and one line here.

    mappa judge-report --db runs/traces.db [--run R] [--judge NAME] [--plot judge.png] [--json]
    mappa override --db runs/traces.db --action ID --score 0.8 --by alice --reason "the code did run"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _open_store(path: str):  # -> TraceStore; imported here so `mappa --help` stays instant
    from .store import TraceStore

    if not Path(path).exists():
        raise CommandError(f"no trace store at {path}: pass the --db file a run wrote (e.g. runs/traces.db)")
    return TraceStore(path)


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="trace store (SQLite file)")
    parser.add_argument("--run", help="only this run (default: all runs)")
    parser.add_argument("--judge", help="only rewards from this judge name (default: the latest of any judge)")
    parser.add_argument("--success-threshold", type=float, default=0.5, help="outcome >= this counts as success")
    parser.add_argument("--group-by", help="episode metadata key to compare mean scores by (e.g. task_type)")
    parser.add_argument("--no-overrides", action="store_true", help="ignore human overrides")
    parser.add_argument("--plot", help="save the report's plot to this PNG file")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def _report(args: argparse.Namespace) -> int:
    from .judge_report import judge_report

    with _open_store(args.db) as store:
        if args.run is not None and args.run not in store.runs():
            raise CommandError(f"unknown run {args.run!r} (runs: {', '.join(store.runs()) or 'none'})")
        report = judge_report(store, args.run, args.judge, success_threshold=args.success_threshold,
                              overrides=not args.no_overrides, group_by=args.group_by)
    if args.json:
        print(report.model_dump_json(indent=2, exclude={"points", "episode_points"}))
    else:
        print(report.to_table())
    if args.plot:
        print(f"plot saved to {report.save_plot(args.plot)}", file=sys.stderr)
    return 0


def _override_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="trace store (SQLite file)")
    parser.add_argument("--action", required=True, help="id of the action to re-score")
    parser.add_argument("--score", required=True, help="the corrected score in [0, 1], or 'none' to exclude it")
    parser.add_argument("--by", required=True, help="who makes the correction")
    parser.add_argument("--reason", required=True, help="why")
    parser.add_argument("--judge", default="human", help="judge name recorded on the override (default: human)")


def _override(args: argparse.Namespace) -> int:
    from .judge_report import override_score

    if args.score.lower() in {"none", "null", "unscored"}:
        score = None
    else:
        try:
            score = float(args.score)
        except ValueError:
            raise CommandError(f"--score {args.score!r} is not a number: give a score in [0, 1] or 'none'") from None
    with _open_store(args.db) as store:
        try:
            reward = override_score(store, args.action, score, by=args.by, reason=args.reason, judge=args.judge)
        except KeyError:
            raise CommandError(f"unknown action {args.action!r} in {args.db}") from None
        except ValueError as exc:
            raise CommandError(f"--score {args.score}: {exc}; scores are in [0, 1]") from None
    print(json.dumps(reward.model_dump(mode="json")))
    return 0


COMMANDS: dict[str, Command] = {
    "judge-report": Command("judge quality over stored episodes: AUROC, per-agent scores, bias probes",
                            _report_arguments, _report),
    "override": Command("record a human correction of one action's score", _override_arguments, _override),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mappa", description="Fine-tune a team of LangGraph agents (MAPPA).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except CommandError as exc:
        print(f"mappa {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
