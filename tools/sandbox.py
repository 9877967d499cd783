"""Run agent-written Python in a separate, locked-down interpreter and hand back what it printed and drew.

Layers, outermost first (each catches what the next one misses):

1. A fresh `python -I -B` child in its own session, with a minimal environment (no API keys inherited), a
   fresh work folder as cwd, and a wall-clock deadline after which the parent kills the process group.
2. `resource` limits set in the child before any user code: address space (memory), CPU seconds, file size,
   open files, core dumps, and RLIMIT_NPROC for non-root users (root ignores it).
3. A PEP 578 audit hook, which cannot be removed once installed: no sockets, no new processes, reads only
   from the work folder, the table and the Python installation, writes only inside the work folder, no
   ctypes, no tracing or `gc` walks that could reach the hook. The hook binds every function it calls as a
   default argument, so rebinding `os.path.realpath` or a builtin from user code does not change its verdict.
4. Friendlier errors on top: `os.fork`, `os.system`, `subprocess.Popen`, ... raise PermissionError naming
   what was blocked, and `ctypes` is a stub module.

PEP 578 says audit hooks are not a sandbox against a determined attacker: hand-crafted bytecode (marshal) or
an interpreter bug can corrupt memory and switch them off. For code from strangers, run this as an
unprivileged user inside a container; the limits in layers 1-2 are what hold then.

Linux only (it reads /proc and waits with os.waitid). Work folders are kept for the caller; clean `root`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, Field

FILE_LIMIT_MB = 64
MAX_LISTED_FILES = 500
SETUP_CPU_SECONDS = 30  # budget for interpreter start, imports and table loading, before the user's limit
_INTERNAL = ".sandbox"  # per-run folder for matplotlib's config and cache; hidden from `files`
_PROJECT_ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ExecResult", "PythonSandbox", "default_root", "make_python_tool", "run_python", "truncate"]


class ExecResult(BaseModel):
    """What one sandboxed run produced; `error` is written for the agent that wrote the code."""

    ok: bool
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    figures: list[str] = Field(default_factory=list, description="PNG files in the work folder")
    files: list[str] = Field(default_factory=list, description="every file left in the work folder")
    duration_s: float = 0.0
    workdir: str

    def as_text(self, max_chars: int = 8000) -> str:
        """The reply a tool-calling agent sees: stdout, then the error, then figure names."""
        parts = [self.stdout.rstrip()] if self.stdout.strip() else []
        if self.error:
            parts.append(f"error: {self.error}")
        if self.figures:
            parts.append("figures: " + ", ".join(Path(f).name for f in self.figures))
        if not parts:
            parts.append("(no output: print() the values you need)")
        return truncate("\n".join(parts), max_chars)


def run_python(
    code: str,
    *,
    table_path: str | Path | None = None,
    workdir: Path | None = None,
    cpu_seconds: float = 10,
    wall_seconds: float = 20,
    memory_mb: int = 1024,
    max_output_chars: int = 8000,
    root: Path | None = None,
) -> ExecResult:
    """Run `code` in a sandboxed child; `df` is the table (if any), `pd`, `np`, `plt` are imported.

    A fresh work folder is made under `root` (default: <tmp>/mappa_sandbox) unless `workdir` is given; it is
    kept afterwards so the caller can read figures and files.
    """
    started = time.monotonic()
    table = _existing_table(table_path)
    folder = _prepare_workdir(workdir, root, table)
    payload = json.dumps(
        {
            "bootstrap": _BOOTSTRAP,
            "code": code,
            "workdir": str(folder),
            "table_path": str(table) if table else None,
            "private_paths": [str(p) for p in {_PROJECT_ROOT, Path.cwd().resolve()} if p != Path("/")],
            "cpu_seconds": math.ceil(cpu_seconds),
            "setup_cpu_seconds": SETUP_CPU_SECONDS,
            "memory_bytes": int(memory_mb) * 1024 * 1024,
            "memory_mb": int(memory_mb),
            "file_bytes": FILE_LIMIT_MB * 1024 * 1024,
        }
    ).encode()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as report:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _LAUNCHER, str(report.fileno())],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            pass_fds=(report.fileno(),),
            cwd=folder,
            env=_child_env(folder),
            start_new_session=True,  # its own process group, so one killpg ends everything it started
        )
        # A thread feeds stdin so that a child that never reads cannot block us past the deadline.
        threading.Thread(target=_feed, args=(proc, payload), daemon=True).start()
        usage, timed_out = _wait(proc, wall_seconds)
        stdout, stderr = _read_text(out), _read_text(err)
        reply = _read_report(report)
    error = _diagnose(
        proc.returncode, usage, timed_out, reply, stderr,
        cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb,
    )
    files = _list_files(folder)
    return ExecResult(
        ok=error is None,
        stdout=truncate(stdout, max_output_chars),
        stderr=truncate(stderr, max_output_chars),
        error=truncate(error, max_output_chars) if error else None,
        figures=[f for f in files if f.lower().endswith(".png")],
        files=files,
        duration_s=round(time.monotonic() - started, 3),
        workdir=str(folder),
    )


class PythonSandbox(BaseModel):
    """Default limits for repeated runs (one per agent team); `run` makes a fresh work folder each time."""

    cpu_seconds: float = Field(10, gt=0, description="CPU seconds the user code may use")
    wall_seconds: float = Field(20, gt=0, description="wall-clock seconds before the process group is killed")
    memory_mb: int = Field(1024, ge=256, description="address-space limit of the child, interpreter included")
    max_output_chars: int = Field(8000, ge=200, description="stdout/stderr/error kept per run")
    root: Path | None = Field(None, description="where work folders go (default <tmp>/mappa_sandbox)")

    def run(self, code: str, *, table_path: str | Path | None = None, workdir: Path | None = None) -> ExecResult:
        return run_python(
            code,
            table_path=table_path,
            workdir=workdir,
            cpu_seconds=self.cpu_seconds,
            wall_seconds=self.wall_seconds,
            memory_mb=self.memory_mb,
            max_output_chars=self.max_output_chars,
            root=self.root,
        )


class _PythonToolInput(BaseModel):
    code: str = Field(description="Python source to run; print() the values you need")


def make_python_tool(
    sandbox: PythonSandbox, table_path: str | Path | None = None, *, name: str = "run_python"
) -> BaseTool:
    """A LangChain tool that runs code in `sandbox` with `table_path` loaded as `df`."""
    table = _existing_table(table_path)
    where = f" The table {table.name} is loaded as `df` and readable at {str(table)!r}." if table else ""
    description = (
        "Run Python code in a sandbox and get back what it printed." + where
        + " pandas as pd, numpy as np and matplotlib.pyplot as plt are imported; open figures are saved as PNG."
        + f" No network, no subprocesses, no files outside the work folder; limits: {sandbox.cpu_seconds:g} s"
        + f" CPU, {sandbox.wall_seconds:g} s wall time, {sandbox.memory_mb} MB memory."
        + " Each call starts a fresh interpreter: variables do not survive between calls."
    )

    def run(code: str) -> str:
        return sandbox.run(code, table_path=table).as_text(sandbox.max_output_chars)

    return StructuredTool.from_function(func=run, name=name, description=description, args_schema=_PythonToolInput)


def truncate(text: str, limit: int) -> str:
    """Keep the head and the tail (where tracebacks end) and say how much was cut."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n... [{len(text) - head - tail} characters truncated] ...\n{text[len(text) - tail:]}"


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "mappa_sandbox"


def _existing_table(table_path: str | Path | None) -> Path | None:
    if table_path is None:
        return None
    table = Path(table_path).expanduser().resolve()
    if not table.is_file():
        raise FileNotFoundError(f"table {str(table_path)!r} does not exist (pass the path of a CSV file)")
    return table


def _prepare_workdir(workdir: Path | None, root: Path | None, table: Path | None) -> Path:
    if workdir is None:
        base = Path(root) if root is not None else default_root()
        base.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="run-", dir=base)).resolve()
    else:
        folder = Path(workdir).resolve()
        folder.mkdir(parents=True, exist_ok=True)
    mpl = folder / _INTERNAL / "mpl"
    mpl.mkdir(parents=True, exist_ok=True)
    for cached in _font_cache(folder.parent if workdir is None else default_root()).glob("fontlist-*.json"):
        shutil.copyfile(cached, mpl / cached.name)  # a copy: one run cannot plant a font list for the next
    if table is not None and not (folder / table.name).exists():
        (folder / table.name).symlink_to(table)  # `pd.read_csv("titanic.csv")` works; writes through it are refused
    return folder


def _font_cache(base: Path) -> Path:
    """matplotlib's font list, built once per root by a trusted child (building it costs ~0.3 s per run)."""
    cache = base / ".mpl-cache"
    if not any(cache.glob("fontlist-*.json")):
        cache.mkdir(parents=True, exist_ok=True)
        env = _child_env(cache) | {"MPLCONFIGDIR": str(cache)}
        try:
            subprocess.run([sys.executable, "-I", "-B", "-c", "import matplotlib.font_manager"],
                           env=env, cwd=cache, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # without the cache each run builds its own font list, only slower
    return cache


def _child_env(folder: Path) -> dict[str, str]:
    """Only what the child needs: the parent's environment may hold API keys."""
    internal = folder / _INTERNAL
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(folder),
        "TMPDIR": str(folder),
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": str(internal / "mpl"),
        "XDG_CACHE_HOME": str(internal),
        "XDG_CONFIG_HOME": str(internal),
        # One BLAS thread: each thread reserves address space, and the memory limit counts it.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _feed(proc: subprocess.Popen[bytes], payload: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(payload)
    except OSError:
        pass  # the child died before reading; _wait reports why
    finally:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _wait(proc: subprocess.Popen[bytes], wall_seconds: float) -> tuple[resource.struct_rusage | None, bool]:
    """Wait for the child, killing its process group at the deadline, and reap it with os.wait4 (its rusage
    tells a CPU-limit kill from others). The group is killed while the child is still an unreaped zombie, so
    its pid and group id cannot have been reused by an unrelated process."""
    deadline = time.monotonic() + wall_seconds
    delay = 0.002
    timed_out = False
    try:
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        _kill_group(proc.pid)  # on timeout the child itself, otherwise anything it left in its group
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # something else in this process reaped it (a waitpid(-1) elsewhere)
        proc.returncode = 0
        return None, timed_out
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage, timed_out


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_text(handle: IO[bytes]) -> str:
    handle.seek(0)
    return handle.read().decode("utf-8", errors="replace")


def _read_report(handle: IO[bytes]) -> dict[str, object]:
    """The child's last JSON line; user code can write there too, so anything unparsable counts as absent."""
    for line in reversed(_read_text(handle).splitlines()):
        try:
            reply = json.loads(line)
        except ValueError:
            continue
        if isinstance(reply, dict):
            return reply
    return {}


def _diagnose(
    returncode: int | None, usage: resource.struct_rusage | None, timed_out: bool, reply: dict[str, object],
    stderr: str,
    *, cpu_seconds: float, wall_seconds: float, memory_mb: int,
) -> str | None:
    """One clear sentence for the agent, from how the child ended."""
    killed_by = -returncode if returncode is not None and returncode < 0 else None
    cpu_used = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
    if timed_out:
        return f"timed out after {wall_seconds:g} s wall time"
    if killed_by == signal.SIGXCPU or (killed_by == signal.SIGKILL and cpu_used >= cpu_seconds):
        return f"CPU time limit exceeded ({cpu_seconds:g} s of CPU time)"
    if reply.get("error"):
        return str(reply["error"])
    if killed_by == signal.SIGXFSZ:
        return f"file size limit of {FILE_LIMIT_MB} MB exceeded"
    if killed_by is not None:
        name = signal.Signals(killed_by).name if killed_by in signal.valid_signals() else f"signal {killed_by}"
        return f"killed by {name} (probably the memory limit of {memory_mb} MB)"
    if returncode:
        last = stderr.strip().splitlines()[-3:]
        return f"exited with status {returncode}" + (": " + " | ".join(last) if last else "")
    return None


def _list_files(folder: Path) -> list[str]:
    """Regular files the run left, at most MAX_LISTED_FILES (a loop can make millions)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) == folder and d == _INTERNAL))
        found += [p for p in (os.path.join(dirpath, f) for f in sorted(filenames)) if not os.path.islink(p)]
        if len(found) >= MAX_LISTED_FILES:
            return found[:MAX_LISTED_FILES]
    return found


# The child reads one JSON object on stdin (bootstrap source, user code, limits) and runs the bootstrap
# under a recognisable file name, so tracebacks can drop its frames.
_LAUNCHER = (
    "import json, sys; config = json.loads(sys.stdin.buffer.read()); config['report_fd'] = int(sys.argv[1]); "
    "exec(compile(config.pop('bootstrap'), '<mappa-sandbox>', 'exec'), "
    "{'__name__': '__mappa_sandbox__', 'CONFIG': config})"
)

# The child's program is a real module (tools/sandbox_child.py) that readers and linters can reach; its source
# is sent to the child on stdin, so the child never imports anything from the project.
_BOOTSTRAP = (Path(__file__).resolve().with_name("sandbox_child.py")).read_text()

