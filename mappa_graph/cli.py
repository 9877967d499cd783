"""The `mappa` command. Each subcommand is one entry in COMMANDS: its help, its arguments, and the function
that runs it (returns the exit status), so a new subcommand is one function pair and one line here.

    mappa train agents.arithmetic:build_trainer --iterations 40 --output-dir runs/arith [--resume]
    mappa plot runs/arith/metrics.jsonl --out rewards.png
    mappa traces --db runs/arith/traces.db --out traces.jsonl
    mappa judge-report --db runs/traces.db [--run R] [--judge NAME] [--plot judge.png] [--json]
    mappa override --db runs/traces.db --action ID --score 0.8 --by alice --reason "the code did run"
    mappa export agents.arithmetic:build_trainer --output-dir runs/arith --out export/arith [--checkpoint PATH]
    mappa serve --manifest export/arith [--port 8000] [--run] [-- EXTRA VLLM ARGS]
    mappa serve --manifest export/arith --upstream http://vllm:8000 [--port 8001] [--api-key KEY]
    mappa serve --manifest export/arith --endpoint [--port 8001]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Command:
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _open_store(path: str):  # -> TraceStore; imported here so `mappa --help` stays instant
    from .capture.store import TraceStore

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
    from .judging.report import judge_report

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
    from .judging.overrides import override_score

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


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    from .training.config import add_config_arguments

    parser.add_argument("recipe", help="module:function that takes a TrainConfig and returns a Trainer "
                                       "(e.g. agents.arithmetic:build_trainer)")
    parser.add_argument("--config", help="YAML/TOML/JSON TrainConfig file; flags below override it")
    parser.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    parser.add_argument("--export", help="write the trained adapters and manifest to this folder at the end")
    parser.add_argument("--from-traces", metavar="DB",
                        help="no rollouts: one update from this trace store (unscored actions judged, human overrides "
                             "win, actions older than --max-staleness iterations dropped)")
    parser.add_argument("--max-staleness", type=int, default=4, help="with --from-traces: iterations (-1: keep all)")
    add_config_arguments(parser)


def _load_recipe(spec: str) -> Callable[..., object]:
    import importlib

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise CommandError(f"recipe {spec!r} must be module:function (e.g. agents.arithmetic:build_trainer)")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CommandError(f"cannot import recipe module {module_name!r}: {exc}") from None
    if not callable(getattr(module, attr, None)):
        raise CommandError(f"module {module_name!r} has no function {attr!r}")
    return getattr(module, attr)


def _train(args: argparse.Namespace) -> int:
    from .serving.export import export_adapters
    from .training.config import TrainConfig, config_from_args
    from .training.metrics import plot_rewards

    base = TrainConfig.from_file(args.config) if args.config else None
    config = config_from_args(args, base)
    recipe = _load_recipe(args.recipe)
    if args.from_traces:
        from .capture.store import TraceStore

        if not Path(args.from_traces).exists():
            raise CommandError(f"no trace store at {args.from_traces}")
        trainer = recipe(config, store=TraceStore(args.from_traces))
    else:
        trainer = recipe(config)
    if args.resume:
        trainer.resume()  # type: ignore[attr-defined]
    if args.from_traces:
        staleness = None if args.max_staleness < 0 else args.max_staleness
        record = trainer.train_from_traces(max_staleness=staleness)  # type: ignore[attr-defined]
        print(json.dumps({"iteration": record["iteration"], "offline": record["offline"]}))
    else:
        trainer.train()  # type: ignore[attr-defined]
    out = Path(config.output_dir)
    print(f"metrics: {out / 'metrics.jsonl'}; plot: {plot_rewards(out / 'metrics.jsonl', out / 'rewards.png')}")
    if args.export:
        export_adapters(trainer.policies, args.export, run=config.run_name, iteration=trainer.iteration)  # type: ignore[attr-defined]
        print(f"adapters and manifest: {args.export}")
    return 0


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--out", default="rewards.png", help="PNG to write")


def _plot(args: argparse.Namespace) -> int:
    from .training.metrics import plot_rewards

    if not Path(args.metrics).exists():
        raise CommandError(f"no metrics file at {args.metrics} (a run writes OUTPUT_DIR/metrics.jsonl)")
    print(plot_rewards(args.metrics, args.out))
    return 0


def _traces_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="trace store (SQLite file)")
    parser.add_argument("--run", help="only this run")
    parser.add_argument("--out", required=True, help="JSONL file to write, one episode a line")


def _traces(args: argparse.Namespace) -> int:
    with _open_store(args.db) as store:
        n = store.export_jsonl(args.out, run=args.run)
    print(f"wrote {n} episodes to {args.out}")
    return 0


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    from .training.config import add_config_arguments

    parser.add_argument("recipe", help="module:function that builds the run's Trainer from a TrainConfig "
                                       "(the recipe `mappa train` ran, e.g. agents.arithmetic:build_trainer)")
    parser.add_argument("--config", help="the run's YAML/TOML/JSON TrainConfig file; flags below override it")
    parser.add_argument("--out", required=True, help="folder to write the adapter folders and manifest.json to")
    parser.add_argument("--checkpoint", help="a checkpoint folder (RUN/checkpoints/iter-N); default: the latest")
    add_config_arguments(parser)


def _export(args: argparse.Namespace) -> int:
    from .serving.export import export_adapters
    from .training.checkpoint import latest_checkpoint, load_checkpoint
    from .training.config import TrainConfig, config_from_args

    base = TrainConfig.from_file(args.config) if args.config else None
    if args.output_dir is None and base is None:
        raise CommandError("--output-dir is required: the run folder whose checkpoints/ to export")
    config = config_from_args(args, base)
    run_dir = Path(config.output_dir)
    try:
        path = Path(args.checkpoint) if args.checkpoint else latest_checkpoint(run_dir / "checkpoints")
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from exc
    if path is None or not (path / "state.pt").exists():
        raise CommandError(f"no checkpoint at {path or run_dir / 'checkpoints'}: train first "
                           f"(mappa train {args.recipe} --output-dir {run_dir}) or pass --checkpoint RUN/checkpoints/iter-N")
    trainer = _load_recipe(args.recipe)(config)
    # load the checkpoint only: Trainer.resume would also trim the run's metrics and traces, and a run may be live
    try:
        payload = load_checkpoint(path, trainer.policies, trainer.optimizers)  # type: ignore[attr-defined]
    except ValueError as exc:  # another team's checkpoint, or one that is not ours
        raise CommandError(str(exc)) from exc
    iteration = int(payload["iteration"])
    manifest = export_adapters(trainer.policies, args.out, run=config.run_name, iteration=iteration,  # type: ignore[attr-defined]
                               version=max(iteration, 1), metrics=_iteration_metrics(run_dir / "metrics.jsonl", iteration))
    for node, entry in manifest.nodes.items():
        print(f"{node}: {entry.adapter_name} -> {Path(args.out) / entry.path}")
    print(f"manifest: {Path(args.out) / 'manifest.json'} (run {config.run_name!r}, iteration {iteration})")
    return 0


def _iteration_metrics(path: Path, iteration: int) -> dict[str, object]:
    """The scalar metrics and per-agent mean rewards a run logged for `iteration` (empty if none)."""
    if not path.exists():
        return {}
    for line in reversed(path.read_text().splitlines()):
        record = json.loads(line) if line.strip() else {}
        if record.get("iteration") == iteration:
            out: dict[str, object] = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
            agents = record.get("agents") or {}
            out["mean_reward"] = {a: m.get("mean_reward") for a, m in agents.items() if isinstance(m, dict)}
            return out
    return {}


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="an export folder (holding manifest.json)")
    parser.add_argument("--host", default="127.0.0.1", help="address vLLM listens on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port vLLM listens on")
    parser.add_argument("--max-loras", type=int, help="adapters per batch (default: the manifest's count)")
    parser.add_argument("--max-lora-rank", type=int, help="default: the largest rank among the adapters")
    parser.add_argument("--run", action="store_true", help="start vLLM (needs it installed) instead of printing")
    parser.add_argument("--upstream", metavar="URL", help="run the routing policy endpoint in front of this vLLM "
                        "server (--enable-lora): each agent's requests go to its manifest adapter")
    parser.add_argument("--endpoint", action="store_true", help="run the policy endpoint on the manifest's adapters "
                        "in this process (no vLLM)")
    parser.add_argument("--api-key", help="the endpoint requires this Bearer key (default: none)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: passed to vLLM as they are")


def _serve(args: argparse.Namespace) -> int:
    import os
    import shlex
    import subprocess

    from .serving.export import load_manifest
    from .serving.vllm import require_vllm, vllm_command

    try:
        manifest = load_manifest(args.manifest)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    if args.upstream or args.endpoint:
        return _serve_endpoint(args, manifest)
    local = manifest.base_model_path and Path(manifest.base_model_path).exists()
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    cmd = vllm_command(manifest.base_model_path if local else manifest.base_model,  # type: ignore[arg-type]
                       adapters=manifest.adapter_names(), served_model_name=manifest.base_model, host=args.host,
                       port=args.port, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, extra_args=extra,
                       python=sys.executable if args.run else "python")
    env_line = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    if not args.run:
        print(f"{env_line} {shlex.join(cmd)}")
        for node, entry in manifest.nodes.items():
            print(f"# node {node}: model={entry.adapter_name!r}", file=sys.stderr)
        return 0
    try:
        require_vllm()
    except ImportError as exc:
        raise CommandError(str(exc)) from None
    print(f"{env_line} {shlex.join(cmd)}", file=sys.stderr)
    return subprocess.run(cmd, env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}).returncode


def _serve_endpoint(args: argparse.Namespace, manifest: Any) -> int:
    """The policy endpoint for a manifest: forwarding to `--upstream` vLLM under each agent's adapter name, or
    sampling the adapters in this process (`--endpoint`). A client names its agent as `model`; an app whose
    chat-model calls should be routed by node runs the endpoint in its own process (PolicyEndpoint.attach)."""
    from .serving.endpoint import PolicyEndpoint

    agents = {node: entry.agent for node, entry in manifest.nodes.items()}
    try:
        if args.upstream:
            from .serving.vllm import VLLMBackend

            backend = VLLMBackend.connect(args.upstream)
            backend.use_manifest(manifest)
            endpoint = PolicyEndpoint(upstream=backend, agents=agents, api_key=args.api_key, host=args.host,
                                      port=args.port)
        else:
            from .serving.local import LocalBackend

            endpoint = PolicyEndpoint(LocalBackend.from_manifest(manifest).policies, agents=agents,
                                      api_key=args.api_key, host=args.host, port=args.port)
    except (ImportError, RuntimeError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    where = f"forwarding to {args.upstream}" if args.upstream else "in-process"
    print(f"policy endpoint on http://{args.host}:{args.port}/v1 ({where}); agents: {', '.join(endpoint.agents)}",
          file=sys.stderr)
    endpoint.serve_forever()
    return 0


COMMANDS: dict[str, Command] = {
    "train": Command("run MAPPA training from a recipe", _train_arguments, _train),
    "plot": Command("draw reward curves per agent from a run's metrics.jsonl", _plot_arguments, _plot),
    "traces": Command("export stored episodes, actions and rewards to JSONL", _traces_arguments, _traces),
    "judge-report": Command("judge quality over stored episodes: AUROC, per-agent scores, bias probes",
                            _report_arguments, _report),
    "override": Command("record a human correction of one action's score", _override_arguments, _override),
    "export": Command("write a run's trained adapters and manifest.json from its checkpoint",
                      _export_arguments, _export),
    "serve": Command("print (or --run) the vLLM command that serves a manifest's adapters, or run the policy "
                     "endpoint (--upstream URL / --endpoint)", _serve_arguments, _serve),
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
