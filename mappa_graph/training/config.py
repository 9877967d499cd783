"""TrainConfig: every knob of a MAPPA run, typed, defaulted and documented in one line, loadable from
YAML/TOML and overridable from the command line (the way TRL keeps GRPOConfig beside GRPOTrainer)."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field

from .credit import RewardConfig


class RayConfig(BaseModel):
    """Where rollouts and judge calls run with rollout_backend="ray" (see mappa_graph/ray_rollouts.py)."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(None, description="Ray cluster to join (None: RAY_ADDRESS, else a local one)")
    runtime_env: dict[str, Any] | None = Field(None, description="Ray runtime_env, e.g. {'working_dir': '.'}")
    workers: int = Field(2, ge=1, description="rollout actors, each holding the base model and the adapters")
    load_base: bool = Field(True, description="workers load the base; False when a server (vLLM) generates: "
                            "workers then get adapter files only")
    concurrency_per_worker: int = Field(1, ge=1, description="episodes each actor runs at once (threads)")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves for each actor")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs Ray reserves for each actor")
    max_restarts: int = Field(2, ge=0, description="times Ray restarts a dead actor")
    max_task_retries: int = Field(2, ge=0, description="times Ray retries a call lost with its actor")


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    run_name: str = Field("mappa", description="name of the run in the trace store and metrics")
    output_dir: str = Field("runs/mappa", description="checkpoints, metrics.jsonl, exports and the trace DB")
    iterations: int = Field(10, ge=1, description="rollout/update iterations")
    tasks_per_iteration: int = Field(8, ge=1, description="tasks drawn per iteration")
    rollouts_per_task: int = Field(2, ge=1, description="G: rollouts of each task per iteration")
    rollout_concurrency: int = Field(4, ge=1, description="episodes run at once")
    async_rollouts: bool | None = Field(None, description="run rollouts with ainvoke (on one long-lived event "
                                        "loop they share); None: when a ToolNode of the app holds a tool that "
                                        "only runs async (an async def @tool, an MCP tool)")
    rollout_backend: Literal["local", "ray"] = Field("local", description="where rollouts and judge calls run")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray workers (rollout_backend='ray')")
    seed: int = Field(0, description="seeds task sampling, sampling and initialisation")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="credit assignment")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of every adapter")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    ppo_epochs: int = Field(1, ge=1, description="optimiser passes over each rollout batch (reward shaping)")
    mini_batches: int = Field(1, ge=1, description="optimiser steps per pass: each adapter's batch, shuffled, "
                              "split into this many mini-batches (TRL's num_mini_batches)")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip")
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="token_mean: every token of the adapter's batch weighs the same (TRL/DAPO); "
        "sequence_mean: every action weighs the same, as in the MAPPA release")
    kl_coef: float = Field(0.01, ge=0, description="KL to the base model (adapter off), the reference's 0.01 "
                           "(measured: benchmarks/sample_efficiency.py --kl-coefs 0,0.01); 0 disables")
    kl_mode: Literal["reward", "loss"] = Field("reward", description="subtract k1 KL from rewards, or add k3 KL to loss")
    max_grad_norm: float | None = Field(1.0, description="gradient clipping per adapter; None disables")
    micro_batch_size: int = Field(16, ge=1, description="samples per forward; gradients accumulate across")
    max_new_tokens: int = Field(32, ge=1, description="generation cap per model call during rollouts")
    temperature: float | None = Field(
        None, gt=0, description="sampling temperature of every sampled model call in rollouts and sampled evaluations "
        "(local, vLLM and endpoint-served models alike; greedy evaluation still decodes greedily); None: each chat "
        "model's own temperature (1.0 unless set)")
    frozen_agents: list[str] = Field(default_factory=list, description="agents whose adapters never update")
    checkpoint_every: int = Field(1, ge=1, description="iterations between checkpoints")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept on disk")
    eval_every: int = Field(0, ge=0, description="iterations between held-out evaluations; 0: only at the end")
    tensorboard: bool = Field(False, description="also log metrics to TensorBoard (needs tensorboard)")

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """Load YAML (.yaml/.yml), TOML (.toml) or JSON; keyword overrides win."""
        path = Path(path)
        if path.suffix not in (".yaml", ".yml", ".toml", ".json"):
            raise ValueError(f"unknown config format {path.suffix!r} for {path} (use .yaml, .toml or .json)")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
        return cls.model_validate({**data, **overrides})


_NESTED = {"reward": RewardConfig, "ray": RayConfig}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One --flag per scalar TrainConfig field (and --reward.x, --ray.x for the nested configs)."""
    for prefix, model in (("", TrainConfig), *((f"{k}.", m) for k, m in _NESTED.items())):
        for name, field in model.model_fields.items():
            if not prefix and name in _NESTED:
                continue
            flag = f"--{prefix}{name}".replace("_", "-")
            kind = _scalar_type(field.annotation)
            if kind is None:
                parser.add_argument(flag, dest=f"{prefix}{name}", default=None, help=f"{field.description} (JSON)")
            elif kind is bool:
                parser.add_argument(flag, dest=f"{prefix}{name}", default=None, type=_bool, help=field.description)
            else:
                parser.add_argument(flag, dest=f"{prefix}{name}", default=None, type=kind, help=field.description)


def config_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    data = (base or TrainConfig()).model_dump()
    for key, value in vars(args).items():
        head, _, rest = key.partition(".")
        if value is None or head not in TrainConfig.model_fields:
            continue
        if rest and head in _NESTED:
            data[head][rest] = _maybe_json(value)
        elif not rest:
            data[key] = _maybe_json(value)
    return TrainConfig.model_validate(data)


def _scalar_type(annotation: Any) -> type | None:
    if annotation in (int, float, str, bool):
        return annotation
    if get_origin(annotation) is Literal:
        return str
    args = [a for a in get_args(annotation) if a is not type(None)]
    if len(args) == 1 and args[0] in (int, float, str):
        return args[0]
    return None


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "[{":
        return json.loads(value)
    return value
