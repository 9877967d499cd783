"""tools/sandbox.py against an attacker: every escape class of issue 15 plus the audit hook's own suite, each
checked from outside the sandbox (always under bubblewrap: the suite pins isolation="bwrap").

All cases run once, in parallel, in a helper process (the "parent" the attacks aim at: it was started with a
secret in its environment, as an agent process started with API keys is). The tests then look at the host:
the canary file's secret appears in no output, nothing new exists outside the work folder (no file, FIFO or
`.pth` in site-packages), no connection reached the loopback listener opened for the case, the environment
secret did not leak, the helper was neither killed nor signalled, no process is left behind, and no work
folder is left on disk. Where the audit hook still catches an attempt, its message is checked too; where only
the isolation layer stops it, the outside checks are the whole assertion.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "examples" / "data" / "dabench" / "tables" / "test_ave.csv"
MARKER = "mappa-escape-marker"  # in the command line of every process an attack tries to leave behind
WALL_SECONDS = 15

NETWORK = "blocked: network access is not allowed in the sandbox"
PROCESS = "blocked: starting processes is not allowed in the sandbox"
READ = "blocked: reading"
WRITE = "blocked: writing"

# What an attacker does once it runs code the audit hook does not see (a spawned interpreter, or this very
# process after the hook is switched off): read the canary, write outside, reach the listener, stay behind.
FREE = """import os, socket, subprocess, sys, time
out = []
try: out.append(open({canary!r}).read())
except Exception as exc: out.append(repr(exc))
try: open({outside!r}, "w").write("escaped"); out.append("wrote")
except Exception as exc: out.append(repr(exc))
try: socket.create_connection(("127.0.0.1", {port}), timeout=1); out.append("connected")
except Exception as exc: out.append(repr(exc))
print(out, flush=True)
"""
LINGER = "import time; time.sleep(60)  # " + MARKER
# a fresh interpreter (no audit hook) holding 300 threads for {hold} s
THREADS = ("import threading, time  # " + MARKER + "\nthreading.stack_size(64 * 1024)\nheld = threading.Event()\n"
           "threads = [threading.Thread(target=held.wait) for _ in range(300)]\n[t.start() for t in threads]\n"
           "time.sleep({hold})\nheld.set()\n[t.join() for t in threads]")

# os.open(path, dir_fd=fd): the "open" audit event carries no dir_fd, so the hook resolves `path` against the
# cwd. From a cwd 40 folders deep, "../"*40 is the work folder to the hook and "/" to the kernel.
DIRFD = """import os
N = 40
os.makedirs("/".join(["d"] * N), exist_ok=True)
os.chdir("/".join(["d"] * N))
top = os.open("/".join([".."] * N), os.O_RDONLY)
def outside(path, flags=os.O_RDONLY, mode=0o644):
    return os.open("../" * N + path.lstrip("/"), flags, mode, dir_fd=top)
"""

FORK_EXEC = """import os, subprocess, sys
def spawn(argv):
    r, w = os.pipe()
    return subprocess._fork_exec([os.fsencode(a) for a in argv], [os.fsencode(argv[0])], True, (), None, None,
                                 -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
"""

ALIAS = """import glob, importlib.machinery, importlib.util, os, sysconfig
def alias(name):
    path = glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload", name + ".*.so"))[0]
    spec = importlib.util.spec_from_loader("innocent." + name,
                                           importlib.machinery.ExtensionFileLoader("innocent." + name, path))
    return importlib.util.module_from_spec(spec)
"""


def _spawn_case(spawner: str) -> str:
    return spawner + (
        "spawn([sys.executable, '-c', {free!r}])\nspawn([sys.executable, '-c', {linger!r}])\n"
        "import time; time.sleep(3)\nprint('spawned')"
    )


NEW_CASES: dict[str, tuple[str, str | None]] = {
    "dirfd-read": (DIRFD + "print(os.read(outside({canary!r}), 1000))", None),
    "dirfd-write": (DIRFD + "os.write(outside({outside!r}, os.O_WRONLY | os.O_CREAT), b'escaped')\nprint('wrote')",
                    None),
    "symlink-swap-race": ("""import os, threading, time
N = 40
os.makedirs("/".join(["d"] * N))
open("inside.txt", "w").write("inside")
bad = "../" * N + {canary!r}.lstrip("/")
stop = time.monotonic() + 2
def swap():
    while time.monotonic() < stop:
        os.symlink("inside.txt", "good"); os.replace("good", "x")
        os.symlink("../" * N + bad, "/".join(["d"] * N) + "/bad")  # resolves inside from down there
        os.replace("/".join(["d"] * N) + "/bad", "x")  # and outside from here
threading.Thread(target=swap, daemon=True).start()
seen = set()
while time.monotonic() < stop:
    try:
        seen.add(open("x").read())
    except OSError:
        pass
print(seen)""", None),
    "subprocess-fork-exec": (_spawn_case(FORK_EXEC), None),
    "alias-posixsubprocess": (_spawn_case(ALIAS + """fork_exec = alias("_posixsubprocess").fork_exec
import sys
def spawn(argv):
    r, w = os.pipe()
    return fork_exec([os.fsencode(a) for a in argv], [os.fsencode(argv[0])], True, (), None, None,
                     -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
"""), None),
    "spawn-then-hang": (FORK_EXEC + "spawn([sys.executable, '-c', {linger!r}])\nimport time\ntime.sleep(60)",
                        f"timed out after {WALL_SECONDS} s wall time"),  # the deadline path must end the spawned one
    "process-flood": (FORK_EXEC + "spawn(['/bin/sh', '-c', 'for i in $(seq 200); do sleep 30 & done; wait'])\n"
                      "import time\ntime.sleep(30)", "stopped: the code started more than 64 processes or 256 threads"),
    # threads are tasks (pids) too; and a watch that had counted them once raised its baseline past them, so
    # processes started once they ended went unseen (an attacker's try: 300 threads, then 100 processes)
    "thread-flood": (FORK_EXEC + "spawn([sys.executable, '-c', {threads!r}.format(hold=30)])\nimport time\n"
                     "time.sleep(30)", "stopped: the code started more than 64 processes or 256 threads"),
    "threads-then-processes": (FORK_EXEC + "spawn([sys.executable, '-c', {threads!r}.format(hold=0.5)])\n"
                               "import time\ntime.sleep(1.5)\n"
                               "spawn(['/bin/sh', '-c', 'for i in $(seq 100); do sleep 30 & done; wait'])\n"
                               "time.sleep(30)", "stopped: the code started more than 64 processes or 256 threads"),
    "alias-ctypes": (ALIAS + "ct = alias('_ctypes')\nprint('loaded', ct)", None),
    "fresh-posix-fifo": ("""import importlib.util
posix = importlib.util.module_from_spec(importlib.util.find_spec("posix"))
posix.mkfifo({fifo!r})
print("fifo made")""", None),
    "readline-history-pth": ("""import readline
readline.add_history("# mappa escape test")
for target in ({site_pth!r}, {outside!r}):
    try:
        readline.write_history_file(target)
        print("wrote", target)
    except OSError as exc:
        print(exc)""", None),
    "ssl-keylog-pth": ("""import ssl
for target in ({site_pth!r}, {outside!r}):
    try:
        ssl.create_default_context().keylog_filename = target
        print("opened", target)
    except (OSError, PermissionError) as exc:
        print(exc)""", None),
    "rust-tokenizers-save": ("""from tokenizers import Tokenizer
from tokenizers.models import BPE
Tokenizer(BPE()).save({outside!r})
print("saved")""", None),
    "proc-self-mem-unhook": (DIRFD + """import sys
try:
    open({canary!r})
except PermissionError as exc:
    tb = exc.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    frame = tb.tb_frame
    while frame.f_code.co_name != "hook":
        frame = frame.f_back
    code = frame.f_code
address = id(code) + type(code).__basicsize__ + 2  # co_code_adaptive, after RESUME
fd = outside("/proc/self/mem", os.O_RDWR)
os.lseek(fd, address, 0)
os.write(fd, bytes([100, code.co_consts.index(None), 83, 0]))  # LOAD_CONST None; RETURN_VALUE
exec({free!r})""", None),
    "pidfd-signal-parent": ("""import importlib.util, _signal, signal, os
posix = importlib.util.module_from_spec(importlib.util.find_spec("posix"))
for pid in {{os.getppid(), {parent_pid}}}:
    try:
        _signal.pidfd_send_signal(posix.pidfd_open(pid), signal.SIGUSR1)
        print("signalled", pid)
    except OSError as exc:
        print(pid, exc)""", None),
    "marshal-bad-code": ("""import marshal
f = lambda: 0
data = bytearray(marshal.dumps(f.__code__))
code = bytes(f.__code__.co_code)
at = data.find(code) + code.index(bytes([100]))  # LOAD_CONST's argument follows its opcode
data[at + 1] = 250  # far past co_consts: the interpreter reads whatever lies there
g = type(f)(marshal.loads(bytes(data)), {{}})
print(repr(g())[:40])""", None),
    "marshal-free-code": ("import marshal\nexec(marshal.loads(marshal.dumps(compile({free!r}, 'x', 'exec'))))", None),
    "disk-fill": ("for i in range(1000):\n    open(f'fill{{i}}.bin', 'wb').write(bytes(60 * 2**20))",
                  "the work folder is full"),
    "proc-environ": (DIRFD + """proc = outside("/proc", os.O_RDONLY | os.O_DIRECTORY)
found = []
for pid in os.listdir(proc):
    if pid.isdigit():
        try:
            found.append(os.read(os.open(pid + "/environ", os.O_RDONLY, dir_fd=proc), 100000))
        except OSError:
            pass
for path in ("/proc/1/environ", "/proc/self/environ", f"/proc/{{os.getppid()}}/environ"):
    try:
        found.append(open(path, "rb").read())
    except OSError:
        pass
print([line for entry in found for line in entry.split(b"\\0") if b"CANARY" in line])""", None),
}

NATIVE = """import glob, importlib.machinery, importlib.util, os, shutil, sysconfig
shutil.copy(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload", "_bisect*.so"))[0], "own.so")
loader = importlib.machinery.ExtensionFileLoader("_bisect", "own.so")
importlib.util.module_from_spec(importlib.util.spec_from_loader("_bisect", loader))"""
REWIRE = """try:
    open({canary!r})
except PermissionError as exc:
    tb = exc.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    frame = tb.tb_frame
    while frame.f_code.co_name != "hook":
        frame = frame.f_back
    check = frame.f_locals["_read"]
    check.__defaults__ = tuple("/" if d == ("/",) else d for d in check.__defaults__)"""
DEVICE = """import importlib.util, os, stat
posix = importlib.util.module_from_spec(importlib.util.find_spec("posix"))  # a fresh posix: the real mknod
posix.mknod("disk", stat.S_IFBLK | 0o600, os.makedev(8, 0))
open("disk", "rb").read(512)"""

# The audit hook's suite from before the isolation layer; each still has to be refused with its message.
HOOK_CASES: dict[str, tuple[str, str | None]] = {
    "socket-localhost": ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))", NETWORK),
    "socket-external": ("import socket\nsocket.create_connection(('example.com', 80), timeout=2)", NETWORK),
    "urllib": ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", NETWORK),
    "write-outside": ("open({outside!r}, 'w').write('escaped')", WRITE),
    "write-through-table-link": ("open({table!r}, 'a').write('x')", None),  # read-only either way
    "read-canary": ("print(open({canary!r}).read())", READ),
    "list-canary-folder": ("import os\nprint(os.listdir({canary_dir!r}))", READ),
    "read-parent-environ": ("import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())", READ),
    "rebind-realpath": (("import os, posixpath\nos.path.realpath = posixpath.realpath = lambda p: '.'\n"
                         "print(open({canary!r}).read())"), READ),
    "symlink-out": ("import os\nos.symlink({canary!r}, 'link.txt')", WRITE),
    "hardlink-out": ("import os\nos.link({canary!r}, 'link.txt')", WRITE),
    "delete-outside": ("import os\nos.remove({canary!r})", WRITE),
    "os-system": ("import os\nos.system('touch {outside}')", PROCESS),
    "subprocess-run": ("import subprocess\nsubprocess.run(['touch', {outside!r}])", PROCESS),
    "posixsubprocess": ("import _posixsubprocess\n_posixsubprocess.fork_exec()", PROCESS),
    "multiprocessing": ("import multiprocessing\nmultiprocessing.Process(target=print).start()", PROCESS),
    "fork-bomb": ("import os\nwhile True:\n    os.fork()", PROCESS),
    "kill-parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "signalling other processes"),
    "infinite-loop": ("while True:\n    pass", "CPU time limit exceeded"),
    "sleep-forever": ("import time\ntime.sleep(60)", f"timed out after {WALL_SECONDS} s wall time"),
    "bytearray-10gb": ("x = bytearray(10 * 1024**3)", "memory limit of 512 MB exceeded"),
    "numpy-10gb": ("a = np.zeros(10 * 1024**3, dtype=np.uint8)\na.fill(1)", "memory limit of 512 MB exceeded"),
    "ctypes": ("import ctypes\nctypes.CDLL(None)", "blocked: ctypes is not allowed in the sandbox"),
    "_ctypes": ("import _ctypes", "blocked: importing _ctypes is not allowed"),
    "settrace": ("import sys\nsys.settrace(lambda *a: None)", "blocked: tracing is not allowed"),
    "raise-rlimit": ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
                     "blocked: changing resource limits"),
    "sqlite-outside": ("import sqlite3\nsqlite3.connect({outside!r})", "blocked: importing sqlite3"),
    "subinterpreter": ("import _xxsubinterpreters", "blocked: importing _xxsubinterpreters"),
    "gc-walk": ("import gc\nprint(len(gc.get_objects()))", "blocked: walking the interpreter's objects"),
    "native-code-from-work-folder": (NATIVE, "blocked: loading native code"),
    "rewire-the-hook": (REWIRE, "blocked: changing the sandbox's own functions"),
    "device-node": (DEVICE, None),  # refused by the kernel (no CAP_MKNOD) or the hook, depending on the uid
}
CASES = NEW_CASES | HOOK_CASES

# Runs in the helper: every case in a thread pool against the real sandbox, results as JSON on stdout.
RUNNER = """import json, os, signal, sys
from concurrent.futures import ThreadPoolExecutor
signals = []
for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda number, frame: signals.append(number))
from tools.sandbox import run_python
job = json.load(open(sys.argv[1]))
def run(item):
    name, code = item
    result = run_python(code.replace("{parent_pid}", str(os.getpid())), table_path=job["table"], root=job["root"],
                        cpu_seconds=1, wall_seconds=job["wall_seconds"], memory_mb=512, isolation="bwrap")
    return name, result.model_dump(mode="json")
with ThreadPoolExecutor(max_workers=4) as pool:
    results = dict(pool.map(run, sorted(job["cases"].items(), key=lambda kv: kv[0] not in ("sleep-forever", "spawn-then-hang"))))
print(json.dumps({"results": results, "signals": signals, "pid": os.getpid()}))
"""


@dataclass
class Host:
    """What the tests look at afterwards, recorded from outside the sandbox."""

    secret: str
    env_secret: str
    canary: Path
    canary_dir: Path
    root: Path
    site: Path
    ports: dict[str, int]
    results: dict[str, dict[str, object]] = field(default_factory=dict)
    helper: dict[str, object] = field(default_factory=dict)
    helper_rc: int | None = None
    helper_err: str = ""
    connections: dict[str, int] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    created_pth: list[str] = field(default_factory=list)
    canary_after: str = ""

    def paths(self, name: str) -> dict[str, Path]:
        return {"outside": self.canary_dir / f"{name}-out", "fifo": self.canary_dir / f"{name}-fifo",
                "site_pth": self.site / f"zzz_mappa_escape_{name}.pth"}


def _pid_namespaces() -> dict[int, tuple[str, str]]:
    """pid -> (pid namespace, command line) for every process this test can see."""
    seen = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ns = os.readlink(f"/proc/{entry}/ns/pid")
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            seen[int(entry)] = (ns, cmdline)
    return seen


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    assert TABLE.is_file(), f"DABench table {TABLE} is missing from the repository"
    base = tmp_path_factory.mktemp("escapes")
    canary_dir, root = base / "canary", base / "root"
    canary_dir.mkdir()
    root.mkdir()
    secret, env_secret = f"canary-{uuid.uuid4().hex}", f"env-canary-{uuid.uuid4().hex}"
    canary = canary_dir / "secret.txt"
    canary.write_text(secret)
    listeners = {name: socket.create_server(("127.0.0.1", 0)) for name in CASES}
    for server in listeners.values():
        server.setblocking(False)
    site = Path(sysconfig.get_paths()["purelib"])
    world = Host(secret=secret, env_secret=env_secret, canary=canary, canary_dir=canary_dir, root=root, site=site,
                 ports={name: s.getsockname()[1] for name, s in listeners.items()})
    cases = {}
    for name, (code, _) in CASES.items():
        paths = world.paths(name)
        free = FREE.format(canary=str(canary), outside=str(paths["outside"]), port=world.ports[name])
        cases[name] = code.format(
            canary=str(canary), canary_dir=str(canary_dir), outside=str(paths["outside"]), fifo=str(paths["fifo"]),
            site_pth=str(paths["site_pth"]), port=world.ports[name], table=TABLE.name, free=free, linger=LINGER, threads=THREADS,
            parent_pid="{parent_pid}")
    job = base / "job.json"
    job.write_text(json.dumps({"cases": cases, "table": str(TABLE), "root": str(root), "wall_seconds": WALL_SECONDS}))
    before = _pid_namespaces()
    env = os.environ | {"MAPPA_ESCAPE_ENV_CANARY": env_secret}  # in the helper's /proc/<pid>/environ
    done = subprocess.run([sys.executable, "-c", RUNNER, str(job)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    world.helper_rc, world.helper_err = done.returncode, done.stderr[-4000:]
    if done.returncode == 0:
        world.helper = json.loads(done.stdout.strip().splitlines()[-1])
        world.results = world.helper["results"]  # type: ignore[assignment]
    own_ns = os.readlink("/proc/self/ns/pid")
    for pid, (ns, cmdline) in _pid_namespaces().items():
        if pid not in before and (MARKER in cmdline or (ns != own_ns and before.get(pid) is None)):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile
            world.leftovers.append(f"{pid} {ns} state {state}: {cmdline[:120]}")
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    for name, server in listeners.items():
        count = 0
        while True:
            try:
                conn, _ = server.accept()
            except BlockingIOError:
                break
            conn.close()
            count += 1
        world.connections[name] = count
        server.close()
    for name in CASES:
        pth = world.paths(name)["site_pth"]
        if pth.exists() or pth.is_symlink():
            world.created_pth.append(str(pth))
            pth.unlink()  # never leave a .pth in the shared venv, even when the test fails
    world.canary_after = canary.read_text() if canary.exists() else "<deleted>"
    yield world


def test_helper_survived_unsignalled(host: Host) -> None:
    assert host.helper_rc == 0, f"the helper (the attacked parent) died with {host.helper_rc}: {host.helper_err}"
    assert host.helper["signals"] == [], f"signals reached the parent: {host.helper['signals']}"
    assert set(host.results) == set(CASES)


def test_no_process_left_behind(host: Host) -> None:
    assert host.leftovers == []


def test_nothing_created_outside(host: Host) -> None:
    assert sorted(p.name for p in host.canary_dir.iterdir()) == ["secret.txt"]
    assert host.canary_after == host.secret
    assert host.created_pth == []


def test_no_work_folder_left(host: Host) -> None:
    left = [p.name for p in host.root.iterdir() if p.name != ".mpl-cache"]
    assert left == [], f"work folders left on disk: {left}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_escape_is_contained(name: str, host: Host) -> None:
    assert name in host.results, f"no result for {name}: {host.helper_err}"
    result = host.results[name]
    said = " ".join(str(result.get(k) or "") for k in ("stdout", "stderr", "error")) + " ".join(
        map(str, result.get("files") or []))
    assert host.secret not in said, f"{name} read the canary file: {said[:300]}"
    assert host.env_secret not in said, f"{name} read the parent's environment: {said[:300]}"
    for kind, path in host.paths(name).items():
        assert not (path.exists() or path.is_symlink()) or kind == "site_pth", f"{name} created {path}"
    assert str(host.paths(name)["site_pth"]) not in host.created_pth, f"{name} wrote a .pth into site-packages"
    assert host.connections[name] == 0, f"{name} reached the loopback listener"
    expected = CASES[name][1]
    if expected is not None:
        assert not result["ok"], result
        assert expected in str(result["error"]), result["error"]
