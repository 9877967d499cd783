"""tools/sandbox.py against code that aims at the parent or at the host's memory rather than at escaping: what
the child writes back (its report, stdout, stderr, the archive of its files) cannot make the parent raise,
spend minutes of CPU or hold hundreds of MB; memory that no per-process limit counts (memfd files, System V
shared memory and message queues) is refused, also to code the audit hook does not see; and the tools around
the sandbox neither replay a failed run nor bind a file outside the dataset's tables folder."""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from pathlib import Path

import pytest

from tests.tools.test_sandbox_escapes import FORK_EXEC
from tools import sandbox as sandbox_module
from tools.sandbox import ExecResult, run_python
from tools.sandbox_seccomp import program

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "examples" / "data" / "dabench" / "tables" / "test_ave.csv"

# The descriptors main() got, reached from the user's code: the report and the archive of its files.
FORGE = "import os, sys\ncfg = sys._getframe(1).f_locals['cfg']\n"

UNCOUNTED = """import ctypes, os
out = []
try:
    os.memfd_create("m"); out.append("memfd made")
except OSError as exc:
    out.append(f"memfd errno {exc.errno}")
libc = ctypes.CDLL(None, use_errno=True)
for name, args in (("shmget", (0, 1 << 20, 0o1600)), ("msgget", (0, 0o1600)), ("semget", (0, 32000, 0o1600))):
    made = getattr(libc, name)(*args)
    out.append(f"{name} errno {ctypes.get_errno()}" if made < 0 else f"{name} made")
try:
    open("/dev/filler", "wb").write(b"x" * (1 << 20)); out.append("wrote to /dev")
except OSError as exc:
    out.append(f"/dev errno {exc.errno}")
print(out, flush=True)
"""


def run(code: str, **kwargs: object) -> ExecResult:
    kwargs.setdefault("wall_seconds", 15)
    return run_python(code, isolation="bwrap", table_path=TABLE, **kwargs)  # type: ignore[arg-type]


def test_memory_no_limit_counts_is_refused_to_hooked_and_unhooked_code() -> None:
    hooked = run("import os\nos.memfd_create('m')")
    assert not hooked.ok and "PermissionError: [Errno 1] Operation not permitted" in (hooked.error or "")
    spawned = run(FORK_EXEC + f"spawn([sys.executable, '-c', {UNCOUNTED!r}])\nimport time; time.sleep(3)")
    assert "['memfd errno 1', 'shmget errno 1', 'msgget errno 1', 'semget errno 1', '/dev errno 30']" in \
        spawned.stdout, spawned  # EPERM from the filter; EROFS: /dev is a tmpfs no size caps


HOST_STATE = """import ctypes, os
out = []
writable = []
for folder, _, names in os.walk("/proc/sys"):
    for name in names:
        try:
            with open(os.path.join(folder, name), "r+b"):
                writable.append(name)
        except OSError:
            pass
out.append(f"{len(writable)} host settings writable")
import platform
libc = ctypes.CDLL(None, use_errno=True)
numbers = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]  # add_key, keyctl: no glibc wrappers
for name, number, args in (("add_key", numbers[0], (b"user", b"planted", b"x", 1, ctypes.c_int(-3))),
                           ("keyctl", numbers[1], (0, ctypes.c_int(-3), 0))):  # the session keyring's id
    made = libc.syscall(number, *args)
    out.append(f"{name} errno {ctypes.get_errno()}" if made < 0 else f"{name} made")
print(out, flush=True)
"""


def test_host_settings_and_kernel_keyrings_are_out_of_reach_of_unhooked_code() -> None:
    """The sandbox's uid is the caller's, host root when the caller is root, and the kernel checks /proc/sys
    writes by file mode and uid only: unhooked code rewrote host-wide settings (`kernel.core_uses_pid`; one
    step from `kernel.core_pattern`, a command run as host root). Kernel keyrings are not namespaced: code
    read the caller's session keyring and planted keys that outlived the run. Found by an attacker's try."""
    spawned = run(FORK_EXEC + f"spawn([sys.executable, '-c', {HOST_STATE!r}])\nimport time; time.sleep(3)")
    assert "['0 host settings writable', 'add_key errno 1', 'keyctl errno 1']" in spawned.stdout, spawned


def test_the_filter_refuses_other_abis_and_is_none_where_it_has_no_numbers() -> None:
    x86 = program("x86_64")
    assert x86 is not None and len(x86) % 8 == 0  # struct sock_filter: 8 bytes each
    assert program("aarch64") != x86 and program("riscv64") is None


@pytest.mark.parametrize("written", [
    b"\n" + b"[" * 100_000 + b"\n",  # json.loads raised RecursionError out of run_python
    b"\n" * (8 << 20),  # every line was parsed: seconds of the parent's CPU per MB
    b"\n[" + b"{}," * (1 << 20) + b"{}]\n",  # a 3 MB line: parsed whole, it held hundreds of MB
])
def test_a_forged_report_is_no_report(written: bytes) -> None:
    result = run(FORGE + f"os.write(cfg['report_fd'], {written!r})\nos._exit(0)")
    assert result.ok and result.error is None and result.files == []


def test_the_report_is_read_from_its_end_and_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[str] = []
    loads = json.loads
    monkeypatch.setattr(sandbox_module.json, "loads", lambda text: parsed.append(text) or loads(text))
    with tempfile.TemporaryFile() as report:
        report.write(b"garbage\n" * 500_000 + b'\n{"error": "boom", "files": ["a.png"]}\n')
        assert sandbox_module._read_report(report) == {"error": "boom", "files": ["a.png"]}  # type: ignore[arg-type]
        assert len(parsed) == 1
        report.seek(0)
        report.truncate()
        report.write(b'{"error": "a line longer than the window"' + b" " * sandbox_module.REPORT_LIMIT_BYTES + b"}")
        assert sandbox_module._read_report(report) == {}  # type: ignore[arg-type]


class _Counted(io.BufferedRandom):
    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def test_output_is_read_only_as_far_as_it_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "out"
    path.write_bytes(b"head " + b"\xff\xfe" * (4 << 20) + b" tail")
    with _Counted(io.FileIO(path, "r+")) as handle:
        text = sandbox_module._read_output(handle, 300)  # type: ignore[arg-type]
        assert handle.read_bytes <= 4 * 300
    assert text.startswith("head \ufffd") and text.endswith("\ufffd tail")
    assert f"... [{8 * 2**20 + 10} bytes in all: the middle is truncated] ..." in text and len(text) < 400
    result = run("import os\nfor _ in range(48):\n    os.write(1, b'\\xff' * (1 << 20))\nprint('end')",
                 max_output_chars=500)
    assert result.ok and result.stdout.endswith("end\n") and len(result.stdout) < 600


def test_a_note_on_stderr_keeps_the_count_of_what_was_cut(tmp_path: Path) -> None:
    """The note on files not copied is added after stderr was cut; cut again, the count read 35 characters."""
    result = run(FORGE + "sys.stderr.write('e' * 100_000)\nsys.stderr.flush()\n"
                 "os.write(cfg['archive_fd'], b'not a tar' * 100)\nos._exit(0)", workdir=tmp_path / "w",
                 max_output_chars=300)
    assert "... [100000 bytes in all: the middle is truncated] ..." in result.stderr
    assert "\nnote: could not copy the run's files" in result.stderr


def test_an_archive_with_a_name_no_path_can_hold_is_not_copied(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("x.txt")
        info.size, info.pax_headers = 2, {"path": "a\x00b.txt"}
        tar.addfile(info, io.BytesIO(b"hi"))
        tar.addfile(tarfile.TarInfo("ok.txt"), io.BytesIO(b""))
    forged = run(FORGE + f"os.write(cfg['archive_fd'], {buffer.getvalue()!r})\nos._exit(0)", workdir=tmp_path / "w")
    assert forged.ok and forged.files == ["ok.txt"]


def test_the_table_tool_replays_only_runs_that_succeeded() -> None:
    from agents.data_analysis import make_table_tool

    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def run(self, code: str, *, table_path: object = None) -> ExecResult:
            self.calls += 1
            if self.calls == 1:
                return ExecResult(ok=False, error="timed out after 20 s wall time")
            return ExecResult(ok=True, stdout="42\n")

    sandbox = Flaky()
    tool = make_table_tool(sandbox)
    ask = {"code": "print(42)", "state": {"table_path": str(TABLE)}}
    assert "timed out" in tool.func(**ask)  # type: ignore[misc]
    assert [tool.func(**ask) for _ in range(2)] == ["42", "42"]  # type: ignore[misc]
    assert sandbox.calls == 2


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/etc/passwd", "..", "sub/t.csv", "", "a\x00.csv"])
def test_a_dataset_table_name_outside_its_tables_folder_is_refused(name: str) -> None:
    from tools.dabench import DABenchTask

    with pytest.raises(ValueError, match="is not a file name in the dataset's tables folder"):
        DABenchTask(id=1, question="q", file_name=name, level="easy")
    assert DABenchTask(id=1, question="q", file_name="test_ave.csv", level="easy").table_path.name == "test_ave.csv"
