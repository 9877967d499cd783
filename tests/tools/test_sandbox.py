"""tools/sandbox.py: normal runs return output, tables and figures; every escape in the suite is refused with
a clear error and leaves the parent (this pytest process) working."""

from __future__ import annotations

import dis
import os
import socket
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.sandbox import _BOOTSTRAP, ExecResult, PythonSandbox, make_python_tool, run_python

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "examples" / "data" / "dabench" / "tables" / "test_ave.csv"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> PythonSandbox:
    return PythonSandbox(root=tmp_path_factory.mktemp("sandbox"), wall_seconds=5, cpu_seconds=2, memory_mb=512)


@pytest.fixture(scope="module")
def table() -> Path:
    assert TABLE.is_file(), f"DABench table {TABLE} is missing from the repository"
    return TABLE


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    """A local server that accepts a connection from this process, so a refused one is the sandbox's doing."""
    server = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(server.getsockname(), timeout=2):
        accepted, _ = server.accept()
        accepted.close()
    server.setblocking(False)
    yield server
    server.close()


def test_prints_stdout(sandbox: PythonSandbox) -> None:
    result = sandbox.run("x = sum(range(10))\nprint('total', x)")
    assert result.ok, result.error
    assert result.stdout == "total 45\n"
    assert result.error is None and result.figures == [] and result.files == []
    assert Path(result.workdir).is_dir() and result.duration_s > 0


def test_each_run_gets_a_fresh_work_folder(sandbox: PythonSandbox) -> None:
    first = sandbox.run("open('notes.txt', 'w').write('hello')\nimport os\nos.mkdir('sub')\nopen('sub/a.csv', 'w')")
    second = sandbox.run("import os\nprint(sorted(f for f in os.listdir('.') if not f.startswith('.')))")
    assert first.ok and second.ok, (first.error, second.error)
    assert first.workdir != second.workdir
    assert first.files == [str(Path(first.workdir) / "notes.txt"), str(Path(first.workdir) / "sub" / "a.csv")]
    assert second.stdout == "[]\n"


def test_given_work_folder_is_used(sandbox: PythonSandbox, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    result = sandbox.run("import os\nopen('out.txt', 'w').write(os.getcwd())", workdir=folder)
    assert result.ok, result.error
    assert result.workdir == str(folder.resolve()) and (folder / "out.txt").read_text() == str(folder.resolve())


def test_df_is_loaded_from_a_real_table(sandbox: PythonSandbox, table: Path) -> None:
    import pandas as pd

    expected = pd.read_csv(table)
    code = "print(type(df).__name__, df.shape[0], df.shape[1])\nprint(round(df['Fare'].mean(), 2))\n"
    code += f"print(len(pd.read_csv(table_path)), len(pd.read_csv({table.name!r})))"
    result = sandbox.run(code, table_path=table)
    assert result.ok, result.error
    rows, cols = expected.shape
    assert result.stdout.splitlines() == [f"DataFrame {rows} {cols}", str(round(expected["Fare"].mean(), 2)),
                                          f"{rows} {rows}"]
    assert result.files == []  # the table's link in the work folder is not a written file


def test_figures_come_back_as_png(sandbox: PythonSandbox) -> None:
    code = "plt.plot([1, 2, 3])\nplt.savefig('mine.png')\nplt.figure()\nplt.bar(['a', 'b'], [3, 1])\n"
    result = sandbox.run(code)
    assert result.ok, result.error
    names = sorted(Path(f).name for f in result.figures)
    assert names == ["figure_1.png", "mine.png"]  # the unsaved second figure was saved for us
    for figure in result.figures:
        assert Path(figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert Path(figure).parent == Path(result.workdir)


def test_exception_comes_back_as_error(sandbox: PythonSandbox) -> None:
    result = sandbox.run("print('before')\nvalues = {'a': 1}\nvalues['b']")
    assert not result.ok
    assert result.stdout == "before\n"
    assert result.error is not None
    assert result.error.splitlines()[-1] == "KeyError: 'b'"
    assert 'File "<code>", line 3' in result.error and "values['b']" in result.error
    assert "<mappa-sandbox>" not in result.error  # the bootstrap's frames are dropped


def test_syntax_error_and_exit_status(sandbox: PythonSandbox) -> None:
    syntax = sandbox.run("def f(:\n    pass")
    assert not syntax.ok and syntax.error is not None and "SyntaxError" in syntax.error
    exited = sandbox.run("import sys\nprint('bye')\nsys.exit(3)")
    assert not exited.ok and exited.error == "exited with status 3" and exited.stdout == "bye\n"
    assert sandbox.run("import sys\nsys.exit(0)").ok


def test_output_is_truncated_with_a_note(tmp_path: Path) -> None:
    result = run_python("print('x' * 50000)\nprint('END')", max_output_chars=1000, root=tmp_path, memory_mb=512)
    assert result.ok
    assert len(result.stdout) < 1100 and "characters truncated" in result.stdout
    assert result.stdout.rstrip().endswith("END")


def test_child_does_not_inherit_secrets(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-the-sandbox")
    result = sandbox.run("import os\nprint(os.environ.get('OPENAI_API_KEY'))")
    assert result.ok and result.stdout == "None\n"


def test_tool_runs_code_for_an_agent(sandbox: PythonSandbox, table: Path) -> None:
    import pandas as pd

    tool = make_python_tool(sandbox, table)
    assert tool.name == "run_python" and table.name in tool.description
    reply = tool.invoke({"code": "print('rows', len(df))\nplt.plot([1, 2])"})
    assert f"rows {len(pd.read_csv(table))}" in reply and "figures: figure_1.png" in reply
    failed = tool.invoke({"code": "import socket\nsocket.create_connection(('example.com', 80))"})
    assert "error:" in failed and "network access is not allowed" in failed
    assert "no output" in tool.invoke({"code": "x = 1"})


def test_missing_table_is_a_clear_error(sandbox: PythonSandbox, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sandbox.run("print(1)", table_path=tmp_path / "nope.csv")


def test_audit_hook_looks_nothing_up_at_call_time() -> None:
    """The hook's functions take every name as a default argument: no globals, builtins or closures that user
    code could rebind, and attribute lookups only on exact str/list/code objects."""
    module = compile(_BOOTSTRAP, "<mappa-sandbox>", "exec")
    lock_down = next(c for c in module.co_consts if isinstance(c, types.CodeType) and c.co_name == "lock_down")
    inner = [c for c in lock_down.co_consts if isinstance(c, types.CodeType)]
    assert {c.co_name for c in inner} >= {"hook", "resolve", "check_read", "check_write", "check_open"}
    safe_attributes = {"startswith", "endswith", "rpartition", "split", "pop", "reverse", "extend", "co_filename"}
    for code in inner:
        instructions = list(dis.get_instructions(code))
        lookups = {i.opname for i in instructions} & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "IMPORT_NAME"}
        assert not lookups, f"{code.co_name} uses {lookups}"
        attributes = {i.argval for i in instructions if i.opname in ("LOAD_ATTR", "LOAD_METHOD")}
        assert attributes <= safe_attributes, f"{code.co_name} looks up {attributes - safe_attributes}"
        assert not code.co_freevars


def test_bootstrap_helpers() -> None:
    """The parts of the child that only run for some users: the task count behind RLIMIT_NPROC (non-root) and
    the read roots, which must not contain the repo even though the venv lives inside it."""
    from tools import sandbox_child

    assert sandbox_child.user_tasks() >= 1
    roots = sandbox_child.read_roots({"private_paths": [str(REPO)]})
    assert roots and not any(str(REPO / "pyproject.toml").startswith(root) for root in roots)
    assert any(root.rstrip("/").endswith("site-packages") for root in roots)


NETWORK = "blocked: network access is not allowed in the sandbox"
PROCESS = "blocked: starting processes is not allowed in the sandbox"
READ = "blocked: reading"
WRITE = "blocked: writing"

NATIVE = """import glob, importlib.machinery, importlib.util, os, shutil, sysconfig
shutil.copy(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "lib-dynload", "_bisect*.so"))[0], "own.so")
loader = importlib.machinery.ExtensionFileLoader("_bisect", "own.so")
importlib.util.module_from_spec(importlib.util.spec_from_loader("_bisect", loader))"""
REWIRE = """try:
    open({project!r})
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


def case(name: str, code: str, expected: str, marks: pytest.MarkDecorator | tuple[()] = ()) -> object:
    return pytest.param(code, expected, id=name, marks=marks)


# Code with {port} {project} {project_dir} {outside} {victim} {table} placeholders, and the text the error
# must contain.
ESCAPES = [
    case("socket-localhost", "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))", NETWORK),
    case("socket-external", "import socket\nsocket.create_connection(('example.com', 80), timeout=2)", NETWORK),
    case("urllib", "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)", NETWORK),
    case("write-tmp", "open({outside!r}, 'w').write('escaped')", WRITE),
    case("write-through-table-link", "open({table!r}, 'a').write('x')", WRITE),
    case("read-project-file", "print(open({project!r}).read())", READ),
    case("list-project-folder", "import os\nprint(os.listdir({project_dir!r}))", READ),
    case("read-parent-environ", "import os\nprint(open(f'/proc/{{os.getppid()}}/environ').read())", READ),
    case("rebind-realpath", "import os, posixpath\nos.path.realpath = posixpath.realpath = lambda p: '.'\n"
         "print(open({project!r}).read())", READ),
    case("symlink-out", "import os\nos.symlink({project!r}, 'link.toml')", WRITE),
    case("hardlink-out", "import os\nos.link({project!r}, 'link.toml')", WRITE),
    case("delete-outside", "import os\nos.remove({victim!r})", WRITE),
    case("os-system", "import os\nos.system('touch {outside}')", PROCESS),
    case("subprocess-run", "import subprocess\nsubprocess.run(['touch', {outside!r}])", PROCESS),
    case("posixsubprocess", "import _posixsubprocess\n_posixsubprocess.fork_exec()", PROCESS),
    case("multiprocessing", "import multiprocessing\nmultiprocessing.Process(target=print).start()", PROCESS),
    case("fork-bomb", "import os\nwhile True:\n    os.fork()", PROCESS),
    case("kill-parent", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "signalling other processes"),
    case("infinite-loop", "while True:\n    pass", "CPU time limit exceeded"),
    case("sleep-forever", "import time\ntime.sleep(60)", "timed out after 5 s wall time"),
    case("bytearray-10gb", "x = bytearray(10 * 1024**3)", "memory limit of 512 MB exceeded"),
    case("numpy-10gb", "a = np.zeros(10 * 1024**3, dtype=np.uint8)\na.fill(1)", "memory limit of 512 MB exceeded"),
    case("ctypes", "import ctypes\nctypes.CDLL(None)", "blocked: ctypes is not allowed in the sandbox"),
    case("_ctypes", "import _ctypes", "blocked: importing _ctypes is not allowed"),
    case("settrace", "import sys\nsys.settrace(lambda *a: None)", "blocked: tracing is not allowed"),
    case("raise-rlimit", "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
         "blocked: changing resource limits"),
    case("sqlite-outside", "import sqlite3\nsqlite3.connect({outside!r})", "blocked: importing sqlite3"),
    case("subinterpreter", "import _xxsubinterpreters", "blocked: importing _xxsubinterpreters"),
    case("gc-walk", "import gc\nprint(len(gc.get_objects()))", "blocked: walking the interpreter's objects"),
    case("native-code-from-work-folder", NATIVE, "blocked: loading native code"),
    case("rewire-the-hook", REWIRE, "blocked: changing the sandbox's own functions"),
    case("device-node", DEVICE, "blocked: opening the device",
         marks=pytest.mark.skipif(os.geteuid() != 0, reason="only root can make device nodes")),
]


@pytest.mark.parametrize(("code", "expected"), ESCAPES)
def test_escape_is_blocked(
    code: str, expected: str, sandbox: PythonSandbox, table: Path, listener: socket.socket, tmp_path: Path
) -> None:
    outside = Path("/tmp") / f"mappa_escape_{tmp_path.name}.txt"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    project = REPO / "pyproject.toml"
    filled = code.format(port=listener.getsockname()[1], project=str(project), project_dir=str(REPO),
                         outside=str(outside), victim=str(victim), table=table.name)
    result = sandbox.run(filled, table_path=table)
    assert isinstance(result, ExecResult) and not result.ok
    assert result.error is not None and expected in result.error, result.error
    assert not outside.exists()
    assert victim.read_text() == "keep me"
    assert project.is_file()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the server


def test_normal_run_still_works_after_the_escape_suite(sandbox: PythonSandbox, table: Path) -> None:
    result = sandbox.run("print(df.columns[0] is not None, np.arange(3).sum())", table_path=table)
    assert result.ok, result.error
    assert result.stdout == "True 3\n"
