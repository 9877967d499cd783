"""The sandbox's system-call filter: refuse the calls that hold host memory no per-process limit counts.

The child's memory limit is RLIMIT_AS, which counts what a process maps. A file on a tmpfs holds memory
without being mapped; the sandbox's own tmpfs mounts are size-capped (and /dev is read-only), but two kinds of
kernel memory are not on any mount: `memfd_create` (and `memfd_secret`) files (an attack held 1.5 GB of host
RAM, 24 of them filled with `os.posix_fallocate`, in a run limited to 256 MB, with plain Python the audit hook
allows) and System V IPC (`shmget`, `msgget`, `semget`: a fresh IPC namespace allows some 64 GB of semaphore
sets alone, and they outlive the process that made them). No data-analysis code needs them, so the filter
makes them fail with EPERM, as it does the kernel keyring calls (`add_key`, `request_key`, `keyctl`: keyrings
are not namespaced, so sandboxed code read the caller's session keyring and planted keys that outlived the
run), and refuses every call made through another ABI than the machine's own (32-bit
`int 0x80` and x32 calls on x86_64), whose numbers differ.

bubblewrap loads the filter (`--seccomp FD`) as a classic BPF program, an array of `struct sock_filter`
(what libseccomp's `seccomp_export_bpf` writes); it is small enough to write out here rather than depend on
libseccomp's Python bindings, which PyPI does not carry. Machines other than x86_64 and aarch64 get no filter
(`program()` returns None) and the sandbox says so in its docstring.
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h)
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of struct seccomp_data
_JUMP_IF_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_FAIL = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO
_NR, _ARCH = 0, 4  # offsets of `nr` and `arch` in struct seccomp_data
_X32_BIT = 0x40000000

# machine -> (AUDIT_ARCH_*, the refused calls' numbers on it)
_REFUSED = {
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64,
                            "add_key": 248, "request_key": 249, "keyctl": 250}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190,
                             "add_key": 217, "request_key": 218, "keyctl": 219}),
}


def _op(code: int, k: int, true: int = 0, false: int = 0) -> bytes:
    return struct.pack("=HBBI", code, true, false, k)


def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one) as bwrap's --seccomp reads it, or None where there is none."""
    found = _REFUSED.get(machine or platform.machine())
    if found is None:
        return None
    arch, numbers = found
    body = [_op(_LOAD_WORD, _NR), _op(_JUMP_IF_AT_LEAST, _X32_BIT, true=len(numbers) + 1)]
    for i, number in enumerate(numbers.values()):  # equal: jump over the rest and the allow, to the refusal
        body.append(_op(_JUMP_IF_EQUAL, number, true=len(numbers) - i))
    body += [_op(_RETURN, _ALLOW), _op(_RETURN, _FAIL)]
    # another ABI: straight to the refusal, the program's last instruction
    return b"".join([_op(_LOAD_WORD, _ARCH), _op(_JUMP_IF_EQUAL, arch, false=len(body) - 1), *body])
