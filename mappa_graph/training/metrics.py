"""Per-iteration metrics: a JSONL file (the record), the console, optionally TensorBoard, and reward plots."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends one JSON line per iteration. On resume, lines past the checkpoint's iteration are dropped,
    so the file never holds an iteration twice."""

    def __init__(self, path: str | Path, *, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)  # else the next line would be appended onto it and the file read as corrupt
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError("tensorboard=True needs the tensorboard package: pip install tensorboard") from exc
            self._tb = SummaryWriter(str(tensorboard_dir))

    def truncate_after(self, iteration: int) -> None:
        """Keep the lines of iterations up to `iteration` (a torn last line, from a kill mid-write, is dropped
        with a warning). The file is rewritten beside itself and renamed over, so a kill here loses nothing."""
        if not self.path.exists():
            return
        keep = [line for line in _complete_lines(self.path) if json.loads(line)["iteration"] <= iteration]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with tmp.open("w") as f:
            f.write("".join(line + "\n" for line in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def write(self, record: Mapping[str, Any]) -> None:
        # one O_APPEND write per line: a kill leaves the line whole or torn at the end, never interleaved
        data = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if self._tb is not None:
            step = int(record["iteration"])
            for key, value in _flatten(record).items():
                if isinstance(value, (int, float)) and key != "iteration":
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no metrics file at {path}")
    return [json.loads(line) for line in _complete_lines(path)]


def _complete_lines(path: Path) -> list[str]:
    """The file's JSON lines; a last line that does not parse (a write cut off by a kill) is dropped with a
    warning, while a bad line anywhere else is corruption and raises."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            json.loads(line)
        except json.JSONDecodeError as exc:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({exc}); the file is corrupt") from exc
            log.warning("%s: dropping a torn last line (%d bytes), left by a run killed while writing it", path,
                        len(line))
            return lines[:-1]
    return lines


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def plot_rewards(metrics_path: str | Path, out_path: str | Path, *, title: str | None = None) -> Path:
    """Mean reward per agent per iteration (and success rate when logged), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path} holds no iterations to plot")
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    success: list[tuple[int, float]] = []
    evals: list[tuple[int, float]] = []
    for r in records:
        for agent, m in r.get("agents", {}).items():
            if m.get("mean_reward") is not None:
                series[agent].append((r["iteration"], m["mean_reward"]))
        if r.get("success_rate") is not None:
            success.append((r["iteration"], r["success_rate"]))
        if r.get("eval_success") is not None:
            evals.append((r["iteration"], r["eval_success"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    for agent, points in sorted(series.items()):
        ax.plot(*zip(*points), marker=".", label=f"{agent} reward")
    if success:
        ax.plot(*zip(*success), "k--", label="rollout success")
    if evals:
        ax.plot(*zip(*evals), "ks-", label="held-out success")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean reward / success")
    ax.set_title(title or Path(metrics_path).parent.name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def _cut_torn_tail(path: Path) -> None:
    """Drop a last line that never got its newline (a write cut off by a kill or a full disk), with a warning."""
    if not path.exists():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    keep = data[: data.rfind(b"\n") + 1]
    log.warning("%s: dropping a torn last line (%d bytes), left by a run killed while writing it", path,
                len(data) - len(keep))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(keep)
    os.replace(tmp, path)
