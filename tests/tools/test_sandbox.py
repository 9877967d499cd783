"""tools/sandbox.py: normal runs return output, tables and figures under bubblewrap; the work folder is gone
afterwards unless copies were asked for; a missing or broken bubblewrap is refused with the fix, and running
without isolation warns on every call. The escape suite is tests/tools/test_sandbox_escapes.py."""

from __future__ import annotations

import dis
import io
import tarfile
import types
import warnings
from pathlib import Path

import pytest

from tools import sandbox as sandbox_module
from tools.sandbox import (
    _BOOTSTRAP,
    INSIDE_WORKDIR,
    ISOLATION_ENV,
    PythonSandbox,
    SandboxIsolationWarning,
    SandboxUnavailableError,
    make_python_tool,
    run_python,
)

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "examples" / "data" / "dabench" / "tables" / "test_ave.csv"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> PythonSandbox:
    return PythonSandbox(root=tmp_path_factory.mktemp("sandbox"), wall_seconds=10, cpu_seconds=2, memory_mb=512,
                         isolation="bwrap")


@pytest.fixture(scope="module")
def table() -> Path:
    assert TABLE.is_file(), f"DABench table {TABLE} is missing from the repository"
    return TABLE


def test_prints_stdout(sandbox: PythonSandbox) -> None:
    result = sandbox.run("x = sum(range(10))\nprint('total', x)")
    assert result.ok, result.error
    assert result.stdout == "total 45\n"
    assert result.error is None and result.figures == [] and result.files == []
    assert result.workdir is None and result.isolation == "bwrap" and result.duration_s > 0


def test_runs_isolated_as_nobody_with_a_private_view(sandbox: PythonSandbox) -> None:
    code = ("import os\nprint(os.getuid(), os.getcwd(), os.uname().nodename)\n"
            "print(os.getpid(), os.getppid())\n"
            "print(os.path.exists({repo!r}), os.path.exists({tests!r}))")
    result = sandbox.run(code.format(repo=str(REPO / "pyproject.toml"), tests=str(REPO / "tests")))
    assert result.ok, result.error
    lines = result.stdout.splitlines()
    assert lines[0] == f"65534 {INSIDE_WORKDIR} sandbox"
    assert lines[1] == "1 0"  # its own pid namespace, where it is the init (bwrap --as-pid-1)
    assert lines[2] == "False False"  # the project holding the venv is not visible, only the venv


def test_each_run_gets_a_fresh_work_folder_and_nothing_is_left(sandbox: PythonSandbox) -> None:
    first = sandbox.run("open('notes.txt', 'w').write('hello')\nimport os\nos.mkdir('sub')\nopen('sub/a.csv', 'w')")
    second = sandbox.run("import os\nprint(sorted(f for f in os.listdir('.') if not f.startswith('.')))")
    assert first.ok and second.ok, (first.error, second.error)
    assert first.files == ["notes.txt", "sub/a.csv"] and first.workdir is None
    assert second.stdout == "[]\n"
    assert [p.name for p in Path(sandbox.root).iterdir()] == [".mpl-cache"]  # type: ignore[arg-type]


def test_given_work_folder_receives_copies(sandbox: PythonSandbox, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    code = "import os\nopen('out.txt', 'w').write(os.getcwd())\nos.mkdir('sub')\nopen('sub/x.txt', 'w').write('x')"
    result = sandbox.run(code, workdir=folder)
    assert result.ok, result.error
    assert result.workdir == str(folder.resolve()) and result.files == ["out.txt", "sub/x.txt"]
    assert (folder / "out.txt").read_text() == INSIDE_WORKDIR and (folder / "sub" / "x.txt").read_text() == "x"


def test_work_folder_is_size_capped(tmp_path: Path) -> None:
    code = "for i in range(100):\n    open(f'fill{i}.bin', 'wb').write(bytes(8 * 2**20))"
    result = run_python(code, root=tmp_path, disk_mb=20, memory_mb=512, wall_seconds=20, isolation="bwrap")
    assert not result.ok and result.error is not None
    assert "the work folder is full (it holds at most 20 MB)" in result.error
    assert "No space left on device" in result.error
    assert [p.name for p in tmp_path.iterdir()] == [".mpl-cache"]


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


def test_figures_come_back_as_png(sandbox: PythonSandbox, tmp_path: Path) -> None:
    code = "plt.plot([1, 2, 3])\nplt.savefig('mine.png')\nplt.figure()\nplt.bar(['a', 'b'], [3, 1])\n"
    result = sandbox.run(code, workdir=tmp_path)
    assert result.ok, result.error
    assert sorted(result.figures) == ["figure_1.png", "mine.png"]  # the unsaved second figure was saved for us
    for figure in result.figures:
        assert (tmp_path / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
    result = run_python("print('x' * 50000)\nprint('END')", max_output_chars=1000, root=tmp_path, memory_mb=512,
                        isolation="bwrap")
    assert result.ok
    assert len(result.stdout) < 1100 and "50005 bytes in all: the middle is truncated" in result.stdout
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


def test_opt_out_warns_on_every_call_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    with pytest.warns(SandboxIsolationWarning, match="WITHOUT isolation") as caught:
        results = [run_python("import os\nprint(os.getcwd() != '/sandbox')", isolation="none", root=tmp_path)
                   for _ in range(2)]
    for result in results:
        assert result.ok and result.stdout == "True\n" and result.isolation == "none", result.error
    assert len([w for w in caught if w.category is SandboxIsolationWarning]) == 2
    monkeypatch.setenv(ISOLATION_ENV, "none")
    with pytest.warns(SandboxIsolationWarning):
        assert run_python("print(1)", root=tmp_path).isolation == "none"
    assert [p.name for p in tmp_path.iterdir()] == [".mpl-cache"]  # its host work folders are removed too
    monkeypatch.setenv(ISOLATION_ENV, "chroot")
    with pytest.raises(ValueError, match="unknown sandbox isolation 'chroot'"):
        run_python("print(1)", root=tmp_path)


def test_default_run_does_not_warn(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISOLATION_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SandboxIsolationWarning)
        assert sandbox.run("print(1)").isolation == "bwrap"


@pytest.fixture()
def fresh_bwrap_check() -> object:
    sandbox_module._bwrap.cache_clear()
    yield
    sandbox_module._bwrap.cache_clear()


def test_missing_bwrap_is_refused_with_the_install_command(
    fresh_bwrap_check: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(SandboxUnavailableError, match=r"apt-get install bubblewrap") as refused:
        run_python("print(1)")
    assert "package `bubblewrap`" in str(refused.value) and "isolation='none'" in str(refused.value)


@pytest.mark.parametrize(("version", "expected"), [
    ("bubblewrap 0.8.0", "cannot create the sandbox's namespaces here (bwrap: No permissions to create new namespace"),
    ("bubblewrap 0.6.1", "needs 0.8 or later"),
])
def test_broken_bwrap_is_refused(
    version: str, expected: str, fresh_bwrap_check: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bwrap that cannot create user namespaces (as in a locked-down container) or is too old to cap the
    work folder: refused, never run with less isolation."""
    fake = tmp_path / "bwrap"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo '{version}'; exit 0; fi\n"
                    "echo 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda *args, **kwargs: str(fake))
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap|unprivileged user namespaces") as e:
        run_python("print(1)")
    assert expected in str(e.value)


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data else None)
    buffer.seek(0)
    return buffer


def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, len(data) if kind == tarfile.REGTYPE else 0, link
    return info, data


def test_copied_files_never_leave_the_given_folder(tmp_path: Path) -> None:
    """The archive comes from code that ran in the sandbox: names reaching outside, links and devices are
    dropped, and the total is capped."""
    dest, outside = tmp_path / "dest", tmp_path / "outside.txt"
    archive = _tar([
        _member("ok.txt", b"fine"), _member("../outside.txt", b"x"), _member(str(outside), b"x"),
        _member("link", kind=tarfile.SYMTYPE, link=str(outside)), _member("dev", kind=tarfile.CHRTYPE),
        _member("sub/deep.txt", b"deep"), _member("big.bin", b"y" * 3000), _member("after.txt", b"z"),
    ])
    kept, note = sandbox_module._save_files(archive, dest, limit_bytes=2000)  # type: ignore[arg-type]
    assert kept == ["ok.txt", "sub/deep.txt"]
    assert note is not None and "were not copied" in note
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["ok.txt", "sub", "sub/deep.txt"]
    assert not outside.exists()
    garbage, note = sandbox_module._save_files(io.BytesIO(b"not a tar" * 100), dest, limit_bytes=2000)  # type: ignore[arg-type]
    assert garbage == [] and note is not None and "could not copy" in note
