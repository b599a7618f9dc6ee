"""Run one child process and measure it: wall time, exit code, and peak resident memory of its
whole process tree.

Peak RSS is the largest of three measurements:
- polling: every `poll_s` seconds, the sum of the RSS of the child and all its descendants
  (psutil), which sees a tree of several processes but can miss a peak shorter than `poll_s`;
- polling as well, the largest ``VmHWM`` (the kernel's peak RSS of a process since its exec) in
  the tree: exact for a single process up to the last poll;
- the kernel's ``ru_maxrss`` of the child (``os.wait4``), the exact peak of the largest single
  process among the child and the descendants it waited for, including one between the last poll
  and the exit. Linux starts it at the RSS the child inherited from this process when it was
  spawned (the forked copy's at exec), so it only counts where it exceeds this process's own peak
  at the spawn; otherwise a large parent (a test process after heavy tests) would report its own
  size as the child's.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = ["ChildResult", "tree_rss_bytes", "run_child", "GIB"]

GIB = float(2 ** 30)


@dataclass
class ChildResult:
    """What `run_child` measured. ``returncode`` is negative for a signal (−9 = killed)."""

    cmd: list[str]
    returncode: int
    wall_s: float
    peak_rss_bytes: int        # max(polled tree sum, polled VmHWM, ru_maxrss where it counts)
    polled_peak_bytes: int     # largest polled sum over the process tree
    maxrss_bytes: int          # ru_maxrss of the child (largest single process), from wait4; 0 where
                               # it did not exceed this process's peak at the spawn (inherited)
    stdout_path: Path
    stderr_path: Path
    timed_out: bool = False
    cpu_s: float = 0.0         # user + system CPU seconds of the child and its waited-for descendants
    loadavg_start: float = 0.0  # 1-minute load average of the machine when the child started / ended
    loadavg_end: float = 0.0
    hwm_bytes: int = 0         # largest polled VmHWM of a process in the tree

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def peak_rss_gib(self) -> float:
        return self.peak_rss_bytes / GIB

    def cpu_share(self, threads: int) -> float:
        """CPU time / (wall time × threads): near 1 for a compute-bound child that had its cores to
        itself; well below 1 when other processes took them (or the child waited on I/O)."""
        return self.cpu_s / max(self.wall_s * threads, 1e-9)

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr_tail(self, n: int = 15) -> str:
        lines = self.stderr_path.read_text(errors="replace").strip().splitlines()
        return "\n".join(lines[-n:])


def tree_rss_bytes(pid: int) -> int:
    """Sum of the resident set sizes of process `pid` and all its descendants (0 if it is gone).

    Processes that exit while being read are skipped. Raises nothing.
    """
    return _tree_memory(pid)[0]


def _tree_memory(pid: int) -> tuple[int, int]:
    """(sum of the RSS, largest VmHWM) over process `pid` and its descendants, in bytes; (0, 0)
    if it is gone. Processes that exit while being read are skipped. Raises nothing."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return 0, 0
    total, hwm = 0, 0
    for p in procs:
        try:
            total += p.memory_info().rss
            hwm = max(hwm, _vm_hwm_bytes(p.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total, hwm


def _vm_hwm_bytes(pid: int) -> int:
    """The kernel's peak RSS of process `pid` since its exec (``VmHWM`` in /proc/PID/status), in
    bytes; 0 where it cannot be read (gone, a zombie, not Linux)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024        # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def run_child(cmd: Sequence[str], stdout_path: str | Path, stderr_path: Optional[str | Path] = None,
              env: Optional[dict] = None, cwd: Optional[str | Path] = None, timeout_s: Optional[float] = None,
              poll_s: float = 0.2, on_line: Optional[Callable[[str], None]] = None) -> ChildResult:
    """Run `cmd` to completion in its own session, its output going to files, and measure it.

    Args:
        cmd: program and arguments.
        stdout_path / stderr_path: files receiving the child's output (stderr defaults to
            ``<stdout_path>.err``).
        env: the child's whole environment (default: inherited).
        cwd: the child's working directory.
        timeout_s: wall-clock limit; past it the child's whole process group is killed
            (SIGTERM, then SIGKILL after 10 s) and ``timed_out`` is set.
        poll_s: interval between RSS samples of the process tree.
        on_line: called with each new stdout line (progress display) while the child runs.

    Returns:
        `ChildResult`. Raises OSError if the program cannot be started.
    """
    out_p = Path(stdout_path)
    err_p = Path(stderr_path) if stderr_path else out_p.with_name(out_p.name + ".err")
    out_p.parent.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB
    t0 = time.perf_counter()
    with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
        proc = subprocess.Popen(list(cmd), stdout=out_f, stderr=err_f, env=env, cwd=cwd, start_new_session=True)
    polled, hwm, status, rusage, timed_out, killed_at = 0, 0, None, None, False, None
    reader = open(out_p, "rb") if on_line else None
    buf = b""
    try:
        while True:
            pid_done, st, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid_done == proc.pid:
                status, rusage = st, ru
                break
            rss, peak = _tree_memory(proc.pid)
            polled, hwm = max(polled, rss), max(hwm, peak)
            if reader is not None:
                buf = _emit_lines(reader, buf, on_line)
            elapsed = time.perf_counter() - t0
            if timeout_s is not None and elapsed > timeout_s and killed_at is None:
                timed_out, killed_at = True, elapsed
                _signal_group(proc.pid, signal.SIGTERM)
            elif killed_at is not None and elapsed > killed_at + 10:
                _signal_group(proc.pid, signal.SIGKILL)
            time.sleep(poll_s)
    finally:
        if status is None:   # interrupted (KeyboardInterrupt): do not leave the child running
            _signal_group(proc.pid, signal.SIGKILL)
            os.waitpid(proc.pid, 0)
        if reader is not None:
            if status is not None:
                _emit_lines(reader, buf, on_line, final=True)
            reader.close()
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)   # reaped by wait4: tell Popen
    maxrss = int(rusage.ru_maxrss) * 1024                  # Linux reports KiB
    maxrss = maxrss if maxrss > inherited + 16 * 2 ** 20 else 0   # else indistinguishable from the inherited RSS
    return ChildResult(list(cmd), proc.returncode, wall, max(polled, hwm, maxrss), polled, maxrss, out_p, err_p,
                       timed_out, cpu_s=rusage.ru_utime + rusage.ru_stime, loadavg_start=load0,
                       loadavg_end=os.getloadavg()[0], hwm_bytes=hwm)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)   # the child leads its own session/group (start_new_session=True)
    except (ProcessLookupError, PermissionError):
        pass


def _emit_lines(reader, buf: bytes, on_line: Callable[[str], None], final: bool = False) -> bytes:
    buf += reader.read()
    *lines, buf = buf.split(b"\n")
    if final and buf:
        lines, buf = [*lines, buf], b""
    for line in lines:
        on_line(line.decode(errors="replace"))
    return buf
