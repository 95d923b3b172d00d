"""Where a server's CPU goes, read from outside: its processes, per-thread CPU time, and py-spy samples.

The serve phase asks, per load run, how much CPU each thread of the prefill and decode scheduler processes used
(``/proc/PID/task/TID/stat``: utime + stime), so a background thread of a KV backend that keeps waking up shows
as seconds of CPU next to the scheduler's main thread. Python thread names come from ``py-spy dump`` (the OS
thread name of a Python thread is its process's); ``py-spy record`` gives sampled stacks per thread
(collapsed "raw" format), summarised here to the frames that take the most samples. Everything degrades to
an ``error`` field when /proc or py-spy is not there (another OS, ptrace not allowed), never to an exception.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

T = TypeVar("T")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children(pid: int) -> list[int]:
    """Every descendant of `pid` (SGLang's scheduler and detokenizer are children of the server process)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                parent[int(d.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def scheduler_pid(server_pid: int) -> Optional[int]:
    """The scheduler process of an SGLang server (its process title, set with setproctitle, begins with
    'sglang::scheduler'), if there is one."""
    for p in children(server_pid):
        if cmdline(p).startswith("sglang::scheduler"):
            return p
    return None


def _per_thread(pid: int, read: Callable[[Path], T]) -> dict[int, T]:
    """`read(task dir)` for every thread of `pid`, by thread id (threads that end meanwhile are skipped)."""
    out: dict[int, T] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            out[int(t.name)] = read(t)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _cpu_s(task: Path) -> float:
    fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid` and its descendants that are still running."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            total += _cpu_s(Path(f"/proc/{p}"))
        except (OSError, IndexError, ValueError):
            continue
    return total


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of every thread of `pid` so far, by thread id."""
    return _per_thread(pid, _cpu_s)


def os_thread_names(pid: int) -> dict[int, str]:
    """Thread id -> the OS thread name (15 bytes; a thread that set none shows its process's title)."""
    return _per_thread(pid, lambda t: (t / "comm").read_text().strip())


def cpu_between(before: dict[int, float], after: dict[int, float], names: dict[int, str],
                min_s: float = 0.01) -> list[dict]:
    """Per-thread CPU seconds spent between two `thread_cpu` snapshots, busiest first, with Python names."""
    rows = [{"tid": tid, "name": names.get(tid, "?"), "cpu_s": round(t - before.get(tid, 0.0), 3)}
            for tid, t in after.items()]
    return sorted((r for r in rows if r["cpu_s"] >= min_s), key=lambda r: -r["cpu_s"])


def python_thread_names(pid: int, pyspy: Optional[str]) -> tuple[dict[int, str], str]:
    """Native thread id -> Python thread name from ``py-spy dump``, and '' or why there are none."""
    if not pyspy:
        return {}, "no py-spy"
    try:
        p = subprocess.run([pyspy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"py-spy dump: {e}"
    if p.returncode != 0:
        return {}, f"py-spy dump exit {p.returncode}: {p.stderr.strip()[-300:]}"
    return parse_dump(p.stdout), ""


def parse_dump(text: str) -> dict[int, str]:
    """Thread lines of ``py-spy dump``: 'Thread 12345 (idle): "name"' on Linux (the OS thread id); a line with
    only a hexadecimal pthread id names no OS thread and is skipped."""
    names = {}
    for line in text.splitlines():
        m = re.match(r'^Thread (\d+) \([^)]*\): "(.*)"', line.strip())
        if m:
            names[int(m.group(1))] = m.group(2)
    return names


def record(pid: int, pyspy: Optional[str], seconds: float, out: Path, rate: int = 200, gil: bool = False,
           native: bool = False) -> str:
    """Start ``py-spy record`` on `pid` for `seconds` in the background; returns an error or ''. The caller
    waits with `wait_record`. `gil`: only the thread holding the GIL is sampled, so each thread's share of the
    samples is its share of the GIL. `native`: C frames too (py-spy --native, which pauses the process for each
    sample: py-spy refuses native frames without)."""
    if not pyspy:
        return "no py-spy"
    try:
        proc = subprocess.Popen([pyspy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                                 str(rate), "--format", "raw", "--threads", *(["--native"] if native else ["--nonblocking"]),
                                 *(["--gil"] if gil else []),
                                 "--output", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return f"py-spy record: {e}"
    _RECORDS[str(out)] = proc
    return ""


_RECORDS: dict[str, subprocess.Popen] = {}


def wait_record(out: Path, timeout: float = 60.0) -> str:
    proc = _RECORDS.pop(str(out), None)
    if proc is None:
        return "not started"
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "py-spy record did not end"
    return "" if proc.returncode == 0 and out.exists() else f"py-spy record exit {proc.returncode}: {err[-300:]}"


#: the process frames `py-spy record --subprocesses` puts before the thread: 'process PID:"command line";' each
#: (a command line may hold ';', as `python -c "a; b"` does); group 1 is the last (innermost) PID
_PROCESS_FRAMES = re.compile(r'(?:process (\d+):"[^"]*";)+')


def raw_stacks(text: str) -> Iterator[tuple[list[str], int]]:
    """(frames, samples) of each line of py-spy's raw output, the thread first (named "process PID thread ..."
    when the record followed subprocesses: PID is the innermost process); other lines are skipped."""
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        procs = _PROCESS_FRAMES.match(stack)
        if procs:
            frames = stack[procs.end():].split(";")
            frames[0] = f"process {procs.group(1)} {frames[0]}"
        else:
            frames = stack.split(";")
        yield frames, int(n)


def summarize_collapsed(text: str, top: int = 12) -> list[dict]:
    """Per thread (first frame of py-spy's --threads stacks): samples, and the self frames with most samples.

    A raw line is 'thread (0x...);frame;frame;... COUNT'; the last frame is where the sample was taken."""
    total: Counter = Counter()
    leaf: dict[str, Counter] = {}
    for frames, count in raw_stacks(text):
        thread = frames[0]
        total[thread] += count
        leaf.setdefault(thread, Counter())[frames[-1]] += count
    return [{"thread": t, "samples": n, "top_self": [{"frame": f, "samples": c} for f, c in leaf[t].most_common(top)]}
            for t, n in total.most_common()]


def samples_within(text: str, markers: tuple[str, ...], top: int = 8) -> list[dict]:
    """Per thread of py-spy's raw stacks: samples, and how many passed through a frame naming each marker (a
    module path such as "sglang_p2p_backend/", counted once a sample), with the inclusive frames of those
    modules that took most: whose code a scheduler thread was in, not only where it stopped."""
    total: Counter = Counter()
    hits: dict[str, Counter] = {}
    frames_in: dict[str, Counter] = {}
    for frames, count in raw_stacks(text):
        thread = frames[0]
        total[thread] += count
        for m in markers:
            inside = [f for f in frames[1:] if m in f]
            if inside:
                hits.setdefault(thread, Counter())[m] += count
                for f in set(inside):
                    frames_in.setdefault(thread, Counter())[f] += count
    return [{"thread": t, "samples": n, "within": {m: hits.get(t, Counter())[m] for m in markers},
             "top_inclusive": [{"frame": f, "samples": c} for f, c in frames_in.get(t, Counter()).most_common(top)]}
            for t, n in total.most_common()]

