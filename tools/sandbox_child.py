"""The sandbox's child program: run inside a fresh `python -I` by `tools.sandbox.run_python` (under bubblewrap
unless isolation was switched off), never imported by the parent process (which sends this file's source to
the child, so the child needs nothing from the project, which bubblewrap does not even show it).

It sets the resource limits, loads pandas, numpy, matplotlib and the table, installs the audit hook that turns
forbidden operations into clear errors, then runs the user's code as `__main__` and reports through a file
descriptor: the error, the files left in the work folder and, when the caller keeps them, a tar of those files.
Everything it reports is read by the parent as untrusted, since user code ran in this same process.
The audit hook is a courtesy to well-meaning code, not the boundary (PEP 578 says as much; issue 15 lists
~15 ways past it); bubblewrap is the boundary.
"""

import errno
import io
import os
import sys

# Modules that reach past the hook: native memory access (ctypes, _testcapi), interpreters without the
# hook (subinterpreters), fork+exec without an audit event (_posixsubprocess, loaded before the lock and
# defused), files opened in C (sqlite3, dbm, shared memory, syslog's socket), /etc/shadow (spwd).
DENIED_IMPORTS = frozenset({
    "ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_xxsubinterpreters",
    "_xxinterpchannels", "_interpreters", "_testcapi", "_testinternalcapi", "_testbuffer",
    "_testmultiphase", "_testsinglephase", "_testclinic", "_testimportmultiple", "_xxtestfuzz",
    "_sqlite3", "sqlite3", "_gdbm", "_dbm", "spwd", "syslog", "nis", "ossaudiodev", "_tkinter",
})


def set_limits(cfg):
    import resource
    import signal

    def cap(kind, value):
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_AS, cfg["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, cfg["file_bytes"])
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, 256)
    cap(resource.RLIMIT_CPU, cfg["cpu_seconds"] + cfg["setup_cpu_seconds"])
    if os.getuid() != 0:  # RLIMIT_NPROC counts every task of the user, and root is exempt from it
        cap(resource.RLIMIT_NPROC, user_tasks() + 32)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write then raises OSError instead of killing


def user_tasks():
    uid, count = str(os.getuid()), 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            count += int(fields.get("Threads", "1"))
    return count


def limit_user_cpu(cpu_seconds):
    """Start the user's CPU budget now, so imports and table loading do not eat into it."""
    import math
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), min(soft + 1, hard)))


def stub_ctypes():
    """pandas imports ctypes at import time; a stub keeps it importable while _ctypes itself stays unloaded."""
    import types

    stub = types.ModuleType("ctypes", "ctypes is blocked in the sandbox")

    def __getattr__(name):
        raise AttributeError(f"blocked: ctypes is not allowed in the sandbox (ctypes.{name})")

    stub.__getattr__ = __getattr__
    sys.modules["ctypes"] = stub


def block_processes():
    """Clear messages for the obvious calls; the audit hook refuses the same events at C level."""
    import _posixsubprocess
    import multiprocessing.process
    import posix
    import signal
    import subprocess

    def refuse(what, reason="starting processes"):
        def blocked(*args, **kwargs):
            raise PermissionError(f"blocked: {reason} is not allowed in the sandbox ({what})")
        return blocked

    names = ["fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp"]
    names += [n for n in dir(os) if n.startswith(("exec", "spawn"))]
    for name in names:
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, refuse(f"os.{name}"))
    for name, reason in [("mkfifo", "making special files"), ("mknod", "making special files"),
                         ("chroot", "changing the root folder"), ("pidfd_open", "signalling other processes")]:
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, refuse(f"os.{name}", reason))
    signal.pidfd_send_signal = refuse("signal.pidfd_send_signal", "signalling other processes")
    _posixsubprocess.fork_exec = refuse("_posixsubprocess.fork_exec")
    multiprocessing.process.BaseProcess.start = refuse("multiprocessing")

    class Popen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            raise PermissionError("blocked: starting processes is not allowed in the sandbox (subprocess)")

    subprocess.Popen = Popen


def read_roots(cfg):
    """The Python installation: stdlib, site-packages and sys.path, minus any folder holding the project."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    candidates = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    candidates += site.getsitepackages() + [p for p in sys.path if p]
    candidates += ["/usr/share/zoneinfo", "/usr/lib/zoneinfo", "/usr/share/fonts", "/usr/local/share/fonts"]
    private = [os.path.realpath(p) + "/" for p in cfg["private_paths"]]
    roots = []
    for path in candidates:
        real = os.path.realpath(path)
        if os.path.isdir(real) and not any(p.startswith(real.rstrip("/") + "/") for p in private):
            roots.append(real.rstrip("/") + "/")
    return tuple(sorted(set(roots)))


def lock_down(workdir, roots, read_files, denied_imports):
    """Install the audit hook. Every name it uses is bound as a default argument and every call is to a C
    function or a method of an exact builtin type, so user code cannot change what the hook sees or does;
    setting __defaults__/__code__ of the sandbox's functions is refused, which protects those bindings."""
    import posix

    network = "network access is not allowed in the sandbox"
    denied_events = {
        "urllib.Request": network, "http.client.connect": network, "ftplib.connect": network,
        "smtplib.connect": network, "imaplib.open": network, "poplib.connect": network,
        "nntplib.connect": network, "telnetlib.Telnet.open": network, "webbrowser.open": network,
        "os.system": "starting processes is not allowed in the sandbox (os.system)",
        "os.exec": "starting processes is not allowed in the sandbox (os.exec)",
        "os.posix_spawn": "starting processes is not allowed in the sandbox (os.posix_spawn)",
        "os.spawn": "starting processes is not allowed in the sandbox (os.spawn)",
        "os.fork": "starting processes is not allowed in the sandbox (os.fork)",
        "os.forkpty": "starting processes is not allowed in the sandbox (os.forkpty)",
        "subprocess.Popen": "starting processes is not allowed in the sandbox (subprocess)",
        "os.killpg": "signalling other processes is not allowed in the sandbox",
        "sqlite3.connect": "sqlite3 is not allowed in the sandbox (it opens files the sandbox cannot check)",
        "sqlite3.connect/handle": "sqlite3 is not allowed in the sandbox",
        "sqlite3.enable_load_extension": "sqlite3 is not allowed in the sandbox",
        "sqlite3.load_extension": "sqlite3 is not allowed in the sandbox",
        "resource.setrlimit": "changing resource limits is not allowed in the sandbox",
        "resource.prlimit": "changing resource limits is not allowed in the sandbox",
        "sys.settrace": "tracing is not allowed in the sandbox",
        "sys.setprofile": "profiling hooks are not allowed in the sandbox",
        "gc.get_objects": "walking the interpreter's objects is not allowed in the sandbox",
        "gc.get_referrers": "walking the interpreter's objects is not allowed in the sandbox",
        "gc.get_referents": "walking the interpreter's objects is not allowed in the sandbox",
        "code.__new__": "building code objects is not allowed in the sandbox",
    }
    # event: ((index of a path argument, index of its dir_fd argument or -1, follow a final symlink), ...);
    # removing or renaming a link acts on the link, so there the last component is not followed.
    write_events = {
        "os.mkdir": ((0, 2, False),), "os.rmdir": ((0, 1, False),), "os.remove": ((0, 1, False),),
        "os.rename": ((0, 2, False), (1, 3, False)), "os.link": ((0, 2, True), (1, 3, False)),
        "os.symlink": ((1, 2, False),), "os.truncate": ((0, -1, True),), "os.chmod": ((0, 2, True),),
        "os.chown": ((0, 3, True),), "os.chflags": ((0, -1, True),), "os.utime": ((0, 3, True),),
        "os.setxattr": ((0, -1, True),), "os.removexattr": ((0, -1, True),), "shutil.rmtree": ((0, 1, False),),
        "shutil.chown": ((0, -1, True),),
    }
    read_events = frozenset({"os.listdir", "os.scandir", "os.chdir", "os.getxattr", "os.listxattr",
                             "os.walk", "os.fwalk"})
    devices = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"})
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    workdir_slash = workdir.rstrip("/") + "/"
    readable = roots + (workdir_slash,)

    def deny(message, _PermissionError=PermissionError):
        raise _PermissionError("blocked: " + message)

    def text_of(obj, _type=type, _issubclass=issubclass, _str=str, _bytes=bytes, _int=int,
                _join="".join, _decode=bytes.decode, _deny=deny):
        """The path as an exact str without running user code (subclasses are copied); None for an fd."""
        if obj is None:
            return "."
        kind = _type(obj)
        if _issubclass(kind, _str):
            return _join((obj,))
        if _issubclass(kind, _bytes):
            return _decode(obj, "utf-8", "surrogateescape")
        if _issubclass(kind, _int):
            return None
        _deny("paths must be str or bytes in the sandbox")

    def resolve(path, _getcwd=posix.getcwd, _lstat=posix.lstat, _readlink=posix.readlink,
                _item=tuple.__getitem__, _OSError=OSError, _deny=deny):
        """os.path.realpath rebuilt from captured C calls (os.stat_result is a mutable type, so no st_mode)."""
        if not path.startswith("/"):
            path = _getcwd() + "/" + path
        done, todo, hops = "", path.split("/"), 0
        todo.reverse()
        while todo:
            name = todo.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                done = done.rpartition("/")[0]
                continue
            candidate = done + "/" + name
            try:
                mode = _item(_lstat(candidate), 0)
            except _OSError:
                mode = 0
            if mode & 0o170000 != 0o120000:
                done = candidate
                continue
            hops += 1
            if hops > 40:
                _deny("too many symbolic links in " + path)
            target = _readlink(candidate)
            if target.startswith("/"):
                done = ""
            parts = target.split("/")
            parts.reverse()
            todo.extend(parts)
        return done or "/"

    def fd_target(fd, _readlink=posix.readlink, _OSError=OSError, _deny=deny):
        try:
            target = _readlink("/proc/self/fd/%d" % fd)
        except _OSError:
            target = ""
        if not target.startswith("/"):
            _deny("file descriptor %d is not a file in the work folder" % fd)
        return target[:-10] if target.endswith(" (deleted)") else target

    def check_write(obj, dir_fd, follow, _text_of=text_of, _resolve=resolve, _fd_target=fd_target,
                    _deny=deny, _type=type, _int=int, _inside=workdir_slash, _devnull="/dev/null",
                    _workdir=workdir):
        path = _text_of(obj)
        if path is None:
            path = _fd_target(obj)
        elif not path.startswith("/") and _type(dir_fd) is _int and dir_fd >= 0:
            path = _fd_target(dir_fd) + "/" + path
        head, _, last = path.rpartition("/")
        if follow or last == "" or last == "." or last == "..":
            real = _resolve(path)
        else:
            real = _resolve(head if head else ".") + "/" + last
        if not (real + "/").startswith(_inside) and real != _devnull:
            _deny("writing " + real + " is not allowed: only the work folder " + _workdir + " is writable")
        return real

    def check_read(obj, _text_of=text_of, _resolve=resolve, _deny=deny, _readable=readable,
                   _files=read_files, _devices=devices):
        path = _text_of(obj)
        if path is None:
            return None  # a file descriptor: opening it was checked already
        real = _resolve(path)
        if not (real + "/").startswith(_readable) and real not in _files and real not in _devices:
            _deny("reading " + real + " is not allowed: only the work folder, the table and the Python "
                  "installation are readable")
        return real

    def check_open(obj, writing, _text_of=text_of, _write=check_write, _read=check_read, _deny=deny,
                   _stat=posix.stat, _item=tuple.__getitem__, _OSError=OSError, _devices=devices,
                   _inside=workdir_slash):
        if _text_of(obj) is None:
            return  # open(fd): the fd was checked when it was opened
        real = _write(obj, -1, True) if writing else _read(obj)
        try:
            kind = _item(_stat(real), 0) & 0o170000
        except _OSError:
            return
        # Device nodes (root can mknod them, even in the work folder) would expose raw disks; a directory fd
        # from outside would let os.open(name, dir_fd=fd) reach past the checks, which see only `name`.
        if (kind == 0o020000 or kind == 0o060000) and real not in _devices:
            _deny("opening the device " + real + " is not allowed in the sandbox")
        if kind == 0o040000 and not (real + "/").startswith(_inside):
            _deny("opening the folder " + real + " is not allowed in the sandbox")

    # Containers the hook holds are immutable (tuples, frozensets): its frame, and so its locals, can be
    # reached from a traceback, and a dict (even behind a mappingproxy) could be emptied from there.
    def hook(event, args, _denied=frozenset(denied_events), _messages=tuple(denied_events.items()),
             _network=network, _deny=deny, _write=check_write, _read=check_read, _open=check_open,
             _text_of=text_of, _writes=frozenset(write_events), _write_specs=tuple(write_events.items()),
             _read_events=read_events, _write_flags=write_flags, _imports=denied_imports,
             _ImportError=ImportError, _getpid=posix.getpid, _type=type, _function=type(deny),
             _guarded=("__code__", "__defaults__", "__kwdefaults__"), _code_of=type(deny).__code__.__get__,
             _own="<mappa-sandbox>", _resolve=resolve, _roots=roots):
        if event == "open":
            _open(args[0], args[2] & _write_flags)
        elif event in _read_events:
            _read(args[0])
        elif event in _writes:
            for name, specs in _write_specs:
                if name == event:
                    for index, fd_index, follow in specs:
                        _write(args[index], args[fd_index] if fd_index >= 0 else -1, follow)
            if event == "os.symlink":  # the link's target must stay inside too
                target = _text_of(args[0])
                if target is None or not target.startswith("/"):
                    target = _write(args[1], args[2], False).rpartition("/")[0] + "/" + (target or "")
                _write(target, -1, True)
        elif event == "import":
            if _text_of(args[0]) in _imports:
                raise _ImportError("blocked: importing " + _text_of(args[0]) + " is not allowed in the sandbox")
            if args[1] is not None:  # a native extension about to be dlopen'ed: only the installation's own
                native = _resolve(_text_of(args[1]))
                if not (native + "/").startswith(_roots):
                    raise _ImportError("blocked: loading native code from " + native + " is not allowed")
        elif event.startswith("socket."):
            _deny(_network)
        elif event.startswith("ctypes."):
            _deny("ctypes is not allowed in the sandbox")
        elif event in _denied:
            for name, message in _messages:
                if name == event:
                    _deny(message)
        elif event == "os.kill":
            if args[0] != _getpid():
                _deny("signalling other processes is not allowed in the sandbox")
        elif event == "object.__setattr__":  # namedtuple sets __defaults__, so guard only the sandbox's own
            if _type(args[0]) is _function and _text_of(args[1]) in _guarded:
                if _code_of(args[0]).co_filename == _own:
                    _deny("changing the sandbox's own functions is not allowed")

    sys.addaudithook(hook)


def load_table(path):
    import pandas as pd

    for encoding in ("utf-8", "latin-1"):  # some DABench tables are latin-1
        try:
            return pd.read_csv(path, encoding=encoding), None
        except UnicodeDecodeError:
            continue
        except Exception as exc:
            return None, f"could not load the table {path}: {type(exc).__name__}: {exc}"
    return None, f"could not decode the table {path}"


def track_saved_figures():
    import functools

    from matplotlib.figure import Figure

    original = Figure.savefig

    @functools.wraps(original)
    def savefig(self, *args, **kwargs):
        self._mappa_saved = True
        return original(self, *args, **kwargs)

    Figure.savefig = savefig


def save_open_figures(plt, workdir):
    saved, number = [], 1
    for num in plt.get_fignums():
        figure = plt.figure(num)
        if getattr(figure, "_mappa_saved", False):
            continue
        while os.path.exists(os.path.join(workdir, f"figure_{number}.png")):
            number += 1
        figure.savefig(os.path.join(workdir, f"figure_{number}.png"))
        saved.append(f"figure_{number}.png")
    plt.close("all")
    return saved


def left_files(workdir, hidden):
    """Regular files the run left, relative to the work folder, at most 500 (a loop can make millions)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(workdir):
        rel = os.path.relpath(dirpath, workdir)
        top = rel == "."
        dirnames[:] = sorted(d for d in dirnames if not (top and d in hidden))
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if (top and name in hidden) or os.path.islink(path) or not os.path.isfile(path):
                continue
            found.append(name if top else os.path.join(rel, name))
            if len(found) >= 500:
                return found
    return found


def archive_files(fd, workdir, names):
    """A tar of the files for a caller that keeps them; the parent unpacks it with tarfile's data filter.
    tarfile is imported by main() before the audit hook is installed."""
    import tarfile

    with os.fdopen(fd, "wb", closefd=False) as raw, tarfile.open(fileobj=raw, mode="w") as tar:
        for name in names:
            try:
                tar.add(os.path.join(workdir, name), arcname=name, recursive=False)
            except OSError:
                continue


def describe(exc, memory_mb, disk_mb=None):
    """The user's traceback without the sandbox's frames; a MemoryError is named as the limit it hit."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
        tb = tb.tb_next
    report = traceback.TracebackException(type(exc), exc, tb)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != "<mappa-sandbox>"])
    lines = "".join(report.format()).rstrip().splitlines()
    if len(lines) > 25:
        lines = lines[:5] + ["  ..."] + lines[-16:]
    text = "\n".join(lines)
    if isinstance(exc, MemoryError):
        return f"memory limit of {memory_mb} MB exceeded\n{text}"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"the work folder is full (it holds at most {disk_mb} MB)\n{text}"
    return text


def main(cfg):
    import json
    import linecache
    import tarfile  # noqa: F401  (archive_files uses it after the user's code; imported before the hook)
    import types

    set_limits(cfg)
    sys.stdin = io.StringIO("")
    sys.argv = ["<code>"]
    workdir = os.path.realpath(cfg["workdir"])
    table = os.path.realpath(cfg["table_path"]) if cfg["table_path"] else None
    stub_ctypes()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import pandas as pd
    track_saved_figures()
    df, note = load_table(table) if table else (None, None)
    if note:
        print("note: " + note, file=sys.stderr)
    block_processes()
    loaded = DENIED_IMPORTS & sys.modules.keys() - {"ctypes", "_posixsubprocess"}  # the stub; defused
    if loaded:
        raise RuntimeError(f"sandbox setup loaded {sorted(loaded)}; refusing to run user code")
    files = frozenset({table, os.path.realpath(sys.executable)} - {None})
    roots = read_roots(cfg)
    limit_user_cpu(cfg["cpu_seconds"])
    lock_down(workdir, roots, files, DENIED_IMPORTS)

    module = types.ModuleType("__main__")
    module.__dict__.update(df=df, pd=pd, np=np, plt=plt, table_path=table)
    sys.modules["__main__"] = module
    code = cfg["code"]
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    error = None
    try:
        exec(compile(code, "<code>", "exec"), module.__dict__)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"exited with status {exc.code}"
    except BaseException as exc:
        error = describe(exc, cfg["memory_mb"], cfg["disk_mb"])
    try:
        save_open_figures(plt, workdir)
    except Exception as exc:
        print(f"note: could not save the open figures: {type(exc).__name__}: {exc}", file=sys.stderr)
    files = left_files(workdir, frozenset(cfg["hidden"]))
    if cfg["archive_fd"] is not None:
        try:
            archive_files(cfg["archive_fd"], workdir, files)
        except Exception as exc:
            print(f"note: could not pack the run's files: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if error is not None and len(error) > 50000:  # the report stays well inside what the parent reads of it
        error = error[:30000] + "\n  ...\n" + error[-20000:]
    files = [name[:300] for name in files]
    report = json.dumps({"error": error, "files": files}, ensure_ascii=False)  # at most 4 bytes a character
    os.write(cfg["report_fd"], ("\n" + report + "\n").encode("utf-8", "replace"))
    os._exit(0)  # skip interpreter teardown: user atexit handlers and finalizers do not get to run


if __name__ == "__mappa_sandbox__":  # run by the launcher in `python -I`, which passes CONFIG in the globals
    main(CONFIG)  # noqa: F821
