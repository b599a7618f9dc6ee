"""engine.malloc: freed tensor memory stays in the process for reuse, malloc_trim returns it, and\nTURBORLHF_MALLOC=system keeps glibc's defaults."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc settings")

# Allocate a 64 MiB tensor (above glibc's largest mmap threshold), write it, free it, and report
# how much of it left the process (resident set before minus after the free, MiB).
_PROBE = textwrap.dedent("""
    import torch
    from turborlhf.engine.malloc import keep_freed_memory
    on = keep_freed_memory()
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    t = torch.ones(16 * 2**20)
    before = rss()
    del t
    print(on, round(before - rss()))
""")


def _probe(env_extra: dict, code: str = _PROBE) -> tuple[bool, int]:
    import os

    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    on, released = out.stdout.split()
    return on == "True", int(released)


def test_freed_memory_stays_for_reuse():
    on, released_mib = _probe({})
    assert on
    assert released_mib < 8                  # kept in the heap: the next step's tensors take it


def test_system_malloc_opt_out_returns_memory():
    on, released_mib = _probe({"TURBORLHF_MALLOC": "system"})
    assert not on
    assert released_mib > 56                 # glibc's default: the block's own mmap, unmapped at once


def test_users_own_malloc_settings_win():
    on, released_mib = _probe({"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert not on and released_mib > 56


def test_release_freed_memory_returns_the_heap():
    code = _PROBE.replace("print(on,", "from turborlhf.engine.malloc import release_freed_memory\n"
                                       "release_freed_memory()\nprint(on,")
    on, released_mib = _probe({}, code)
    assert on and released_mib > 56


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "unknown"


def test_prefer_huge_pages_sets_torchs_switch_unless_opted_out(monkeypatch):
    from turborlhf.engine.malloc import prefer_huge_pages

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setenv("TURBORLHF_MALLOC", "system")
    assert not prefer_huge_pages() and "THP_MEM_ALLOC_ENABLE" not in os.environ
    monkeypatch.delenv("TURBORLHF_MALLOC")
    assert prefer_huge_pages() and os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")                # the user's own setting wins
    assert not prefer_huge_pages()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this kernel")
def test_huge_pages_fault_a_large_tensor_in_with_few_faults():
    """64 MiB written once: 16,384 faults of 4 KiB pages without huge pages, ~32 with them."""
    code = textwrap.dedent("""
        import resource
        from turborlhf.engine.malloc import keep_freed_memory, prefer_huge_pages
        prefer_huge_pages()
        import torch
        keep_freed_memory()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.ones(16 * 2**20)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    """)
    faults = {}
    for name, extra in (("huge", {}), ("system", {"TURBORLHF_MALLOC": "system"})):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"} | extra
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        faults[name] = int(out.stdout.split()[-1])
    assert faults["system"] > 10_000 and faults["huge"] < faults["system"] // 4, faults
