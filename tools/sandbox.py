"""Run agent-written Python in a separate, locked-down interpreter and hand back what it printed and drew.

Layers, outermost first:

1. **The boundary: bubblewrap** (`bwrap`, Debian/Ubuntu package `bubblewrap`). The child runs with every
   namespace unshared (its network is a private loopback, its /proc shows only its own processes), as uid
   65534 with no capabilities, in a new session that dies with its parent. It sees the system's /usr and the
   Python installation and venv read-only, the table read-only, a private /tmp, /proc and /dev, and a work
   folder that is a size-capped tmpfs, gone when the run ends. `bwrap` itself starts with a minimal
   environment (inside, /proc/1/environ is bwrap's own), so no API key is there to read.
2. The parent's watch: a wall-clock deadline, and at most MAX_PROCESSES processes and MAX_TASKS threads, past
   which it kills the sandbox's pid-namespace init, so that the kernel ends everything the child started
   before the call returns.
3. `resource` limits set in the child before any user code: address space, CPU seconds, file size, open
   files, core dumps, and RLIMIT_NPROC where the kernel applies it (not when the caller is root: see below).
4. A PEP 578 audit hook and friendly stubs (`tools/sandbox_child.py`): clear errors for well-meaning code
   that tries the network, subprocesses or files outside the work folder. Not the boundary: issue 15 shows
   ~15 ways past it (dir_fd paths, native writes without audit events, /proc/self/mem); layer 1 holds then.

Without `bwrap`, or where user namespaces are disabled, `run_python` refuses with `SandboxUnavailableError`
(naming the package and the command that installs it). Running without isolation is an explicit opt-in,
`isolation="none"` or `MAPPA_SANDBOX_ISOLATION=none`, which warns on every call. There is no silent downgrade.

A seccomp filter (tools/sandbox_seccomp.py, x86_64 and aarch64) refuses the calls that hold host memory no
per-process limit counts (`memfd_create`, `memfd_secret`, System V IPC) and other ABIs' calls; /dev (a tmpfs
with no size cap) is read-only.

/proc/sys (host-wide kernel settings) is an empty read-only folder, and the filter also refuses the kernel
keyring calls, as keyrings are shared with the host.

Known limits: an unprivileged `bwrap` can only map the sandbox's uid to the caller's own, so when the caller
is root the sandboxed processes are host root without capabilities (in every namespace of their own), and
RLIMIT_NPROC, which the kernel does not apply to root, is replaced by the parent's process watch. Limits are
per process (no cgroup): code that gets past the audit hook and starts processes can use up to the memory and
CPU limits in each of them until the wall-clock deadline. The filter refuses only the calls above, so a kernel
bug reachable from an unprivileged process is outside what this layer stops. Runs at the same time share the
read-only files they see (a `flock` on one is visible to the other).

The work folder is removed after each run; `files` and `figures` name what the run left there, and a caller
that wants them passes `workdir`, which receives copies (at most `disk_mb` in all, regular files only).
Linux only.
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
import tarfile
import tempfile
import threading
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Literal

from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, Field

from .sandbox_seccomp import program as seccomp_program

FILE_LIMIT_MB = 64
MAX_LISTED_FILES = 500
# The child's report (its last line: at most 50k characters of error text and 500 file names of at most 300, as
# UTF-8) stays under this; the parent reads no more of the report file than this from its end, since the code
# in the child can write there too.
REPORT_LIMIT_BYTES = 2 * 1024 * 1024
SETUP_CPU_SECONDS = 30  # budget for interpreter start, imports and table loading, before the user's limit
ISOLATION_ENV = "MAPPA_SANDBOX_ISOLATION"
INSIDE_WORKDIR = "/sandbox"  # the work folder's path as the sandboxed code sees it
SANDBOX_UID = 65534  # "nobody" inside the user namespace
MAX_PROCESSES = 64  # processes in one sandbox (see _SandboxWatch); the hook already refuses fork and exec
MAX_TASKS = 256  # threads of all its processes together (each is one of the host's pids)
PRIVATE_TMP_MB = 16  # the sandbox's own /tmp and /dev/shm are small tmpfs too
_INTERNAL = ".sandbox"  # per-run folder for matplotlib's config and cache; hidden from `files`
_PROJECT_ROOT = Path(__file__).resolve().parents[1]
_INSTALL = "install it with `apt-get install bubblewrap` (Debian/Ubuntu package `bubblewrap`; scripts/setup.sh " \
           "does this when run as root)"
_OPT_OUT = f"or, for trusted code only, run without isolation: isolation='none' or {ISOLATION_ENV}=none"

Isolation = Literal["bwrap", "none"]

__all__ = [
    "ExecResult", "Isolation", "PythonSandbox", "SandboxIsolationWarning", "SandboxUnavailableError",
    "default_root", "make_python_tool", "run_python", "truncate",
]


class SandboxUnavailableError(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here; the message names the fix."""


class SandboxIsolationWarning(UserWarning):
    """Agent code is about to run without the isolation layer (an explicit opt-in)."""


# "Warns on every call": Python's default filter would show this once per call site and then stay silent.
warnings.simplefilter("always", SandboxIsolationWarning)


class ExecResult(BaseModel):
    """What one sandboxed run produced; `error` is written for the agent that wrote the code."""

    ok: bool
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    figures: list[str] = Field(default_factory=list, description="PNG files the run left, relative to its folder")
    files: list[str] = Field(default_factory=list, description="every file the run left, relative to its folder")
    duration_s: float = 0.0
    workdir: str | None = Field(None, description="host folder holding copies of `files`, when one was asked for")
    isolation: Isolation = "bwrap"

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
    disk_mb: int = 128,
    max_output_chars: int = 8000,
    root: Path | None = None,
    isolation: Isolation | None = None,
) -> ExecResult:
    """Run `code` in a sandboxed child; `df` is the table (if any), `pd`, `np`, `plt` are imported.

    The work folder holds at most `disk_mb` and is removed afterwards; pass `workdir` to get copies of the
    files the run left there (figures included). `root` holds matplotlib's font cache (and, without isolation,
    the temporary work folders). `isolation` defaults to $MAPPA_SANDBOX_ISOLATION, else "bwrap".
    """
    mode = _isolation(isolation)
    started = time.monotonic()
    table = _existing_table(table_path)
    base = Path(root) if root is not None else default_root()
    with ExitStack() as stack:
        out, err, report, archive, info = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(5))
        kept_fds = [report.fileno(), info.fileno()]
        if mode == "bwrap":
            syscalls = _seccomp_file(stack)
            kept_fds += [syscalls.fileno()] if syscalls is not None else []
            launch = _bwrap_launch(table, base, disk_mb, info.fileno(), syscalls.fileno() if syscalls else None)
        else:
            launch = _unisolated_launch(stack, table, base)
        payload = json.dumps(
            {
                "bootstrap": _BOOTSTRAP,
                "code": code,
                "workdir": launch.workdir,
                "table_path": str(table) if table else None,
                "private_paths": [str(p) for p in {_PROJECT_ROOT, Path.cwd().resolve()} if p != Path("/")],
                "cpu_seconds": math.ceil(cpu_seconds),
                "setup_cpu_seconds": SETUP_CPU_SECONDS,
                "memory_bytes": int(memory_mb) * 1024 * 1024,
                "memory_mb": int(memory_mb),
                "disk_mb": int(disk_mb),
                "file_bytes": FILE_LIMIT_MB * 1024 * 1024,
                "hidden": launch.hidden,
                "report_fd": report.fileno(),
                "archive_fd": archive.fileno() if workdir is not None else None,
            }
        ).encode()
        proc = subprocess.Popen(
            [*launch.prefix, sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _LAUNCHER],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            # the archive only for a caller that keeps the files: a descriptor passed is 64 MB of our disk to fill
            pass_fds=(*kept_fds, *([archive.fileno()] if workdir is not None else [])),
            cwd=launch.cwd,
            env=_child_env(launch.workdir),  # bwrap's own environment too: inside, /proc/1/environ is bwrap's
            start_new_session=True,  # its own process group, so one killpg ends everything it started
        )
        # A thread feeds stdin so that a child that never reads cannot block us past the deadline.
        threading.Thread(target=_feed, args=(proc, payload), daemon=True).start()
        usage, stopped = _wait(proc, wall_seconds, info if mode == "bwrap" else None)
        stdout, stderr = _read_output(out, max_output_chars), _read_output(err, max_output_chars)
        reply = _read_report(report)
        files, note = _listed_files(reply), None
        if workdir is not None:
            files, note = _save_files(archive, Path(workdir), disk_mb * 1024 * 1024)
    error = _diagnose(
        proc.returncode, usage, stopped, reply, stderr, isolated=mode == "bwrap",
        cpu_seconds=cpu_seconds, wall_seconds=wall_seconds, memory_mb=memory_mb,
    )
    if note:  # after the cut: stderr is already as long as it may be, and a note is one short line
        stderr = f"{stderr}\nnote: {note}" if stderr else f"note: {note}"
    return ExecResult(
        ok=error is None,
        stdout=stdout,
        stderr=stderr,
        error=truncate(error, max_output_chars) if error else None,
        figures=[f for f in files if f.lower().endswith(".png")],
        files=files,
        duration_s=round(time.monotonic() - started, 3),
        workdir=str(Path(workdir).resolve()) if workdir is not None else None,
        isolation=mode,
    )


class PythonSandbox(BaseModel):
    """Default limits for repeated runs (one per agent team); each run gets a fresh work folder."""

    cpu_seconds: float = Field(10, gt=0, description="CPU seconds the user code may use")
    wall_seconds: float = Field(20, gt=0, description="wall-clock seconds before the sandbox is killed")
    memory_mb: int = Field(1024, ge=256, description="address-space limit of the child, interpreter included")
    disk_mb: int = Field(128, ge=1, description="size of the work folder (a tmpfs), removed after each run")
    max_output_chars: int = Field(8000, ge=200, description="stdout/stderr/error kept per run")
    root: Path | None = Field(None, description="where the font cache goes (default <tmp>/mappa_sandbox)")
    isolation: Isolation | None = Field(None, description=f"'bwrap' (default) or 'none'; None reads ${ISOLATION_ENV}")

    def run(self, code: str, *, table_path: str | Path | None = None, workdir: Path | None = None) -> ExecResult:
        return run_python(
            code,
            table_path=table_path,
            workdir=workdir,
            cpu_seconds=self.cpu_seconds,
            wall_seconds=self.wall_seconds,
            memory_mb=self.memory_mb,
            disk_mb=self.disk_mb,
            max_output_chars=self.max_output_chars,
            root=self.root,
            isolation=self.isolation,
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
        + f" CPU, {sandbox.wall_seconds:g} s wall time, {sandbox.memory_mb} MB memory, {sandbox.disk_mb} MB disk."
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


def _isolation(isolation: Isolation | None) -> Isolation:
    """The isolation to use: bwrap (checked to work here) unless "none" was asked for, which warns."""
    chosen = isolation if isolation is not None else (os.environ.get(ISOLATION_ENV) or "bwrap")
    if chosen == "none":
        warnings.warn(
            "running agent-written code WITHOUT isolation (isolation='none' or "
            f"{ISOLATION_ENV}=none): only the audit hook stands between it and this machine's files, network "
            "and processes, and it is not a boundary; use this for trusted code only",
            SandboxIsolationWarning, stacklevel=3,
        )
        return "none"
    if chosen != "bwrap":
        raise ValueError(f"unknown sandbox isolation {chosen!r} (choose 'bwrap' or 'none'; check ${ISOLATION_ENV})")
    _bwrap()
    return "bwrap"


@lru_cache(maxsize=1)
def _bwrap() -> str:
    """The `bwrap` binary, once checked to be new enough and able to create namespaces here (a container
    without user namespaces fails here, not in the middle of an agent's episode). Failures are not cached."""
    path = shutil.which("bwrap", path="/usr/local/bin:/usr/bin:/bin:" + os.environ.get("PATH", ""))
    if path is None:
        raise SandboxUnavailableError(
            f"bubblewrap (`bwrap`) is not installed, and the Python sandbox runs agent code under it: {_INSTALL}; "
            + _OPT_OUT)
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    numbers = tuple(int(n) for n in version.stdout.split()[-1].split(".")[:2] if n.isdigit()) if version.stdout else ()
    if numbers < (0, 8):
        raise SandboxUnavailableError(
            f"{path} is bubblewrap {version.stdout.strip() or '(unknown version)'}, but the sandbox needs 0.8 or "
            f"later (--size caps the work folder, --disable-userns): {_INSTALL} from a newer release; " + _OPT_OUT)
    with ExitStack() as stack:  # the namespaces, mounts and filter every run needs (a container may refuse /proc)
        syscalls = _seccomp_file(stack)
        probe = subprocess.run(
            [path, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1",
             "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--size", "65536", "--tmpfs", "/tmp",
             *(["--seccomp", str(syscalls.fileno())] if syscalls is not None else []), "--", "true"],
            capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"}, check=False,
            pass_fds=[syscalls.fileno()] if syscalls is not None else [])
    if probe.returncode != 0:
        raise SandboxUnavailableError(
            f"bubblewrap cannot create the sandbox's namespaces here ({probe.stderr.strip() or probe.returncode}):"
            " allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ "
            "also kernel.apparmor_restrict_unprivileged_userns=0; in Docker, a seccomp profile that allows "
            "CLONE_NEWUSER); " + _OPT_OUT)
    return path


@dataclass
class _Launch:
    """How to start the child: a command prefix (bwrap and its arguments, or nothing), the work folder as the
    child sees it, the parent-side cwd, top-level names the child must not report as its files."""

    prefix: list[str]
    workdir: str
    cwd: str
    hidden: list[str] = field(default_factory=list)


def _seccomp_file(stack: ExitStack) -> IO[bytes] | None:
    """The system-call filter (tools/sandbox_seccomp.py) in a file bwrap reads, or None on a machine without
    one."""
    code = seccomp_program()
    if code is None:
        return None
    handle = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 - closed by the caller's stack
    handle.write(code)
    handle.seek(0)
    return handle


def _bwrap_launch(table: Path | None, base: Path, disk_mb: int, info_fd: int, seccomp_fd: int | None = None) -> _Launch:
    """bwrap's arguments, in mount order (a later mount may sit inside an earlier one, never the reverse)."""
    uid, small, inside = str(SANDBOX_UID), str(PRIVATE_TMP_MB * 1024 * 1024), INSIDE_WORKDIR
    args = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
            "--uid", uid, "--gid", uid, "--hostname", "sandbox", "--new-session", "--die-with-parent", "--as-pid-1",
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or the real folders
        top = Path("/", name)
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    # /proc/sys: host-wide kernel settings, which the kernel lets a process write by file mode and uid alone
    # (the sandbox's uid is host root's when the caller is root); bwrap covers it only when it looks writable
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache", "--proc", "/proc",
             "--tmpfs", "/proc/sys", "--remount-ro", "/proc/sys", "--dev", "/dev",
             "--size", small, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",  # /dev itself is an uncapped tmpfs
             "--size", small, "--tmpfs", "/tmp"]
    for folder in _python_folders():
        args += ["--ro-bind", folder, folder]
    args += ["--size", str(disk_mb * 1024 * 1024), "--tmpfs", inside, "--dir", f"{inside}/{_INTERNAL}/mpl"]
    for cached in _font_cache(base).glob("fontlist-*.json"):  # read-only: one run cannot plant one for the next
        args += ["--ro-bind", str(cached), f"{inside}/{_INTERNAL}/mpl/{cached.name}"]
    hidden = [_INTERNAL]
    if table is not None:  # at its own path (as the tool's description says) and as a name in the work folder
        args += ["--ro-bind", str(table), str(table), "--ro-bind", str(table), f"{inside}/{table.name}"]
        hidden.append(table.name)
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += ["--info-fd", str(info_fd), "--remount-ro", "/", "--chdir", inside, "--"]
    return _Launch(prefix=args, workdir=inside, cwd="/", hidden=hidden)


def _python_folders() -> list[str]:
    """The Python installation and venv (prefixes, stdlib, site-packages), outermost folders only; never the
    project, which may hold the venv but is not bound itself."""
    import sysconfig

    candidates = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                  str(Path(os.path.realpath(sys.executable)).parent), *sysconfig.get_paths().values()}
    folders = set()
    for candidate in candidates:
        for path in {os.path.abspath(candidate), os.path.realpath(candidate)}:
            if os.path.isdir(path) and path not in ("/", "/usr") and not path.startswith("/usr/"):
                folders.add(path.rstrip("/"))
    return sorted(f for f in folders if not any(f.startswith(other + "/") for other in folders))


def _unisolated_launch(stack: ExitStack, table: Path | None, base: Path) -> _Launch:
    """The opt-out: a host work folder under `base`, removed when the run ends."""
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=base)).resolve()
    stack.callback(shutil.rmtree, folder, ignore_errors=True)
    mpl = folder / _INTERNAL / "mpl"
    mpl.mkdir(parents=True)
    for cached in _font_cache(base).glob("fontlist-*.json"):
        shutil.copyfile(cached, mpl / cached.name)  # a copy: one run cannot plant a font list for the next
    hidden = [_INTERNAL]
    if table is not None:
        (folder / table.name).symlink_to(table)  # `pd.read_csv("titanic.csv")` works; writes through it are refused
        hidden.append(table.name)
    return _Launch(prefix=[], workdir=str(folder), cwd=str(folder), hidden=hidden)


def _font_cache(base: Path) -> Path:
    """matplotlib's font list, built once per root by a trusted child (building it costs ~0.3 s per run)."""
    cache = base / ".mpl-cache"
    if not any(cache.glob("fontlist-*.json")):
        cache.mkdir(parents=True, exist_ok=True)
        env = _child_env(str(cache)) | {"MPLCONFIGDIR": str(cache)}
        try:
            subprocess.run([sys.executable, "-I", "-B", "-c", "import matplotlib.font_manager"],
                           env=env, cwd=cache, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired):
            pass  # without the cache each run builds its own font list, only slower
    return cache


def _child_env(folder: str) -> dict[str, str]:
    """Only what the child needs: the parent's environment may hold API keys."""
    internal = f"{folder}/{_INTERNAL}"
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": folder,
        "TMPDIR": folder,
        "LANG": "C.UTF-8",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": f"{internal}/mpl",
        "XDG_CACHE_HOME": internal,
        "XDG_CONFIG_HOME": internal,
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


def _wait(
    proc: subprocess.Popen[bytes], wall_seconds: float, info: IO[bytes] | None
) -> tuple[resource.struct_rusage | None, str | None]:
    """Wait for the child, stopping it at the deadline (or, under bwrap, past MAX_PROCESSES), and reap it with
    os.wait4 (its rusage tells a CPU-limit kill from others); returns why we stopped it, if we did. The group
    is killed while the child is still an unreaped zombie, so its pid and group id cannot have been reused by
    an unrelated process. Under bwrap (`info` holds bwrap's report) the sandbox's pid-namespace init is
    killed, and we wait until it is gone: the kernel ends every process in the namespace before its init
    dies, so then nothing the code started is left."""
    deadline = time.monotonic() + wall_seconds
    delay = 0.002
    stopped = None
    sandbox = _SandboxWatch(info, proc.pid) if info is not None else None
    try:
        while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "wall"
                break
            if sandbox is not None and sandbox.too_many_processes():
                stopped = "processes"
                break
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)
        if sandbox is not None and stopped and sandbox.init() is not None:
            # Kill the namespace's init, not bwrap: bwrap then reaps it and exits by itself. Killing bwrap
            # first would leave the init's zombie to whatever reaps orphans (in a container, maybe no one).
            _kill_group(sandbox.init())  # type: ignore[arg-type]
            _await_exit(proc.pid, timeout=2.0)
        _kill_group(proc.pid)  # on timeout the child itself, otherwise anything it left in its group
        _, status, usage = os.wait4(proc.pid, 0)
    except ChildProcessError:  # something else in this process reaped it (a waitpid(-1) elsewhere)
        proc.returncode = 0
        return None, stopped
    finally:
        if sandbox is not None and sandbox.init() is not None:
            _await_exit(sandbox.init())  # type: ignore[arg-type]
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage, stopped


class _SandboxWatch:
    """The running sandbox as the parent sees it: its pid-namespace init and how many processes it holds.

    RLIMIT_NPROC does not bind when the caller is root (the sandbox's uid maps to host root), so a process
    bomb that got past the audit hook is stopped here: the host's task count (/proc/loadavg, one cheap read)
    is watched, and only when it has grown by MAX_PROCESSES are the sandbox's own processes and threads counted."""

    def __init__(self, info: IO[bytes], bwrap_pid: int) -> None:
        self._info, self._bwrap_pid = info, bwrap_pid
        self._report: dict[str, object] | None = None
        self._init: int | None = None
        self._baseline = _host_tasks()

    def _read(self) -> dict[str, object] | None:
        """bwrap's --info-fd report. The sandbox could write to that file too, so the init's pid counts only
        while its parent is our bwrap."""
        if self._report is None:
            try:
                self._info.seek(0)
                report = json.JSONDecoder().raw_decode(self._info.read(65536).decode("utf-8", "replace").lstrip())[0]
                pid = int(report["child-pid"])
                with open(f"/proc/{pid}/status") as status:
                    parent = next(line.split()[1] for line in status if line.startswith("PPid:"))
            except (ValueError, KeyError, TypeError, OSError, StopIteration):
                return None  # not written yet, or not bwrap's
            if int(parent) == self._bwrap_pid:
                self._report, self._init = report, pid
        return self._report

    def init(self) -> int | None:
        self._read()
        return self._init

    def too_many_processes(self) -> bool:
        if _host_tasks() - self._baseline <= MAX_PROCESSES:  # the sandbox's own tasks, or others' load
            return False
        report = self._read()
        if report is None:
            return False
        namespace, processes, tasks = f"pid:[{report.get('pid-namespace')}]", 0, 0
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and os.readlink(f"/proc/{entry}/ns/pid") == namespace:
                    processes += 1
                    tasks += len(os.listdir(f"/proc/{entry}/task"))  # its threads: each is a pid of the host's
            except OSError:
                continue
        # Others' load is what the host holds beyond the sandbox's own tasks: look again after a further rise.
        # (Set to the whole count, the baseline took in the sandbox's threads, and processes started once they
        # ended went unseen.)
        self._baseline = _host_tasks() - tasks
        return processes > MAX_PROCESSES or tasks > MAX_TASKS


def _host_tasks() -> int:
    """Tasks on the host (the kernel's count behind /proc/loadavg's "running/total" field)."""
    try:
        with open("/proc/loadavg") as loadavg:
            return int(loadavg.read().split()[3].partition("/")[2])
    except (OSError, IndexError, ValueError):
        return 0


def _await_exit(pid: int, timeout: float = 5.0) -> None:
    """Until `pid` is a zombie or gone (a dying pid-namespace init turns zombie only once its namespace is
    empty); bounded, since a reaper elsewhere owns it by now."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)


def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_output(handle: IO[bytes], limit: int) -> str:
    """What the child wrote to stdout or stderr, as `truncate` keeps it, reading only the head and the tail
    it keeps: the child can write up to the file size limit, in bytes that are not UTF-8, and all of it read
    and decoded held hundreds of MB in the parent."""
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    if size <= 4 * limit:  # a UTF-8 character is at most 4 bytes
        return truncate(handle.read().decode("utf-8", errors="replace"), limit)
    head_chars, tail_chars = limit * 2 // 3, limit // 3
    head = handle.read(4 * head_chars).decode("utf-8", errors="replace")[:head_chars]
    handle.seek(size - 4 * tail_chars)
    tail = handle.read().decode("utf-8", errors="replace")[-tail_chars:] if tail_chars else ""
    return f"{head}\n... [{size} bytes in all: the middle is truncated] ...\n{tail}"


def _read_report(handle: IO[bytes]) -> dict[str, object]:
    """The child's report: the last line of its report file, which the child writes as it ends. The code in the
    child can write there too (and end before the report is written), so only that line is read, at most
    REPORT_LIMIT_BYTES of it, and anything that is not a JSON object counts as no report: parsing every line
    of a file of empty lines took minutes of the parent's CPU, and one deeply nested line raised RecursionError
    out of the run."""
    size = os.fstat(handle.fileno()).st_size
    handle.seek(max(0, size - REPORT_LIMIT_BYTES))
    lines = handle.read().rstrip(b"\n").rsplit(b"\n", 1)
    if size > REPORT_LIMIT_BYTES and len(lines) == 1:
        return {}  # the last line began before the window: not one the child wrote
    try:
        reply = json.loads(lines[-1].decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        return {}
    return reply if isinstance(reply, dict) else {}


def _diagnose(
    returncode: int | None, usage: resource.struct_rusage | None, stopped: str | None, reply: dict[str, object],
    stderr: str,
    *, isolated: bool, cpu_seconds: float, wall_seconds: float, memory_mb: int,
) -> str | None:
    """One clear sentence for the agent, from how the child ended."""
    killed_by = -returncode if returncode is not None and returncode < 0 else None
    if isolated and returncode is not None and returncode > 128:
        killed_by = returncode - 128  # bwrap exits with 128 + the signal that ended the child
    cpu_used = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
    if stopped == "wall":
        return f"timed out after {wall_seconds:g} s wall time"
    if stopped == "processes":
        return f"stopped: the code started more than {MAX_PROCESSES} processes or {MAX_TASKS} threads"
    if killed_by == signal.SIGXCPU or (killed_by == signal.SIGKILL and cpu_used >= cpu_seconds):
        return f"CPU time limit exceeded ({cpu_seconds:g} s of CPU time)"
    if reply.get("error"):
        return str(reply["error"])
    if killed_by == signal.SIGXFSZ:
        return f"file size limit of {FILE_LIMIT_MB} MB exceeded"
    if killed_by is not None:
        name = signal.Signals(killed_by).name if killed_by in signal.valid_signals() else f"signal {killed_by}"
        if killed_by == signal.SIGKILL:
            return f"killed by {name} (probably the memory limit of {memory_mb} MB)"
        return f"crashed: killed by {name}"
    if returncode:
        last = stderr.strip().splitlines()[-3:]
        return f"exited with status {returncode}" + (": " + " | ".join(last) if last else "")
    return None


def _listed_files(reply: dict[str, object]) -> list[str]:
    """The file names the child reported (it is not trusted: only short strings, at most MAX_LISTED_FILES)."""
    names = reply.get("files")
    if not isinstance(names, list):
        return []
    return [n[:300] for n in names if isinstance(n, str)][:MAX_LISTED_FILES]


def _save_files(archive: IO[bytes], dest: Path, limit_bytes: int) -> tuple[list[str], str | None]:
    """Unpack the child's tar of its work folder into `dest`: regular files only, at most limit_bytes in all
    (a tar can claim sizes it does not hold), through tarfile's "data" filter, which refuses absolute paths,
    `..`, links and devices. The archive comes from code we do not trust."""
    dest.mkdir(parents=True, exist_ok=True)
    archive.seek(0)
    if not archive.read(1):
        return [], None
    archive.seek(0)
    kept, total, note = [], 0, None
    try:
        with tarfile.open(fileobj=archive, mode="r:") as tar:
            for member in tar:
                if len(kept) >= MAX_LISTED_FILES:
                    break
                if not member.isfile() or member.name.startswith("/") or ".." in Path(member.name).parts:
                    continue  # the child writes plain relative names: anything else is not ours
                if total + member.size > limit_bytes:
                    note = f"files past {limit_bytes // 2**20} MB were not copied to {dest}"
                    break
                try:
                    tar.extract(member, dest, filter="data")
                except (tarfile.FilterError, ValueError):
                    continue  # a name reaching outside `dest`, or one no path can hold (a NUL): never ours
                kept.append(member.name)
                total += member.size
    except (tarfile.TarError, OSError, ValueError) as exc:
        note = f"could not copy the run's files to {dest}: {exc}"
    return kept, note


# The child reads one JSON object on stdin (bootstrap source, user code, limits) and runs the bootstrap
# under a recognisable file name, so tracebacks can drop its frames.
_LAUNCHER = (
    "import json, sys; config = json.loads(sys.stdin.buffer.read()); "
    "exec(compile(config.pop('bootstrap'), '<mappa-sandbox>', 'exec'), "
    "{'__name__': '__mappa_sandbox__', 'CONFIG': config})"
)

# The child's program is a real module (tools/sandbox_child.py) that readers and linters can reach; its source
# is sent to the child on stdin, so the child never imports anything from the project.
_BOOTSTRAP = (Path(__file__).resolve().with_name("sandbox_child.py")).read_text()

