"""The C build cache: a library is rebuilt when its source or a header it includes changes."""
import ctypes
import warnings

import pytest

from turborlhf.engine import cbuild

needs_cc = pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler / kernels off")


@needs_cc
def test_editing_an_included_header_rebuilds(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBORLHF_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    src.write_text('#include "v.h"\nint value(void) { return VALUE; }\n')
    (tmp_path / "v.h").write_text("#define VALUE 1\n")
    first = cbuild.build_shared_library(src, cbuild.compiler())
    assert cbuild.build_shared_library(src, cbuild.compiler()) == first      # cached
    (tmp_path / "v.h").write_text("#define VALUE 2\n")
    second = cbuild.build_shared_library(src, cbuild.compiler())
    assert second != first
    assert ctypes.CDLL(str(first)).value() == 1 and ctypes.CDLL(str(second)).value() == 2


def test_source_text_reads_quoted_includes_beside_the_source(tmp_path):
    src = tmp_path / "k.c"
    src.write_text('#include <stdint.h>\n  # include "a.h"\nint x;\n')
    (tmp_path / "a.h").write_text("HEADER")
    text = cbuild._source_text(src)
    assert text.startswith(src.read_text()) and text.endswith("HEADER")


@pytest.fixture
def one_c(tmp_path, monkeypatch):
    """A C source defining one() = 1, with an empty build cache and no library loaded yet."""
    monkeypatch.setenv("TURBORLHF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cbuild, "_loaded", {})
    src = tmp_path / "k.c"
    src.write_text("int one(void) { return 1; }\n")
    return src


@needs_cc
def test_load_library_prepares_once_and_honours_the_switch(one_c, monkeypatch):
    src = one_c
    calls = []
    lib = cbuild.load_library(src, "test kernel", prepare=calls.append)
    assert lib is not None and lib.one() == 1
    assert cbuild.load_library(src, "test kernel", prepare=calls.append) is lib and calls == [lib]
    monkeypatch.setenv("TURBORLHF_KERNELS", "0")
    assert cbuild.load_library(src, "test kernel") is None


@needs_cc
def test_a_failing_prepare_falls_back_with_one_warning(one_c):
    src = one_c

    def prepare(lib):
        lib.missing_function.argtypes = []

    with pytest.warns(UserWarning, match="test kernel unavailable"):
        assert cbuild.load_library(src, "test kernel", prepare=prepare) is None
    assert cbuild.load_library(src, "test kernel", prepare=prepare) is None      # not retried, no warning


@needs_cc
def test_a_compiler_command_line_in_cc_is_split(one_c, monkeypatch):
    """$CC as make reads it ("ccache gcc", "gcc -pipe") was run as one executable name, so every
    kernel build failed and the trainers fell back to torch ops."""
    monkeypatch.setenv("CC", f"{cbuild.compiler()} -pipe")
    lib = cbuild.load_library(one_c, "test kernel")
    assert lib is not None and lib.one() == 1


@needs_cc
def test_a_failed_build_probed_quietly_still_warns_once_when_used(one_c):
    """A warn=False probe (the optimizer-state choice) used to cache the failure silently: the
    kernel's users then fell back to torch ops, ~70x slower for AdamW, without a word."""
    one_c.write_text("this is not C\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cbuild.load_library(one_c, "test kernel", warn=False) is None
    with pytest.warns(UserWarning, match="test kernel unavailable.*RuntimeError"):
        assert cbuild.load_library(one_c, "test kernel") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cbuild.load_library(one_c, "test kernel") is None      # once


def test_the_cache_key_names_the_cpu_flags_not_only_its_model(tmp_path, monkeypatch):
    """A VM may call a Zen 3 and a Zen 4 both "AMD EPYC": the key read the model name only, so a
    cache shared between them loaded one's -march=native build on the other."""
    info = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma{}\n"
    cpuinfo = tmp_path / "cpuinfo"
    real_path = cbuild.Path

    def path(p, *a):
        return real_path(cpuinfo) if str(p) == "/proc/cpuinfo" else real_path(p, *a)

    monkeypatch.setattr(cbuild, "Path", path)
    cpuinfo.write_text(info.format(""))
    zen3 = cbuild._cpu_model()
    cpuinfo.write_text(info.format(" avx512f avx512_bf16"))
    zen4 = cbuild._cpu_model()
    assert "AMD EPYC" in zen3 and zen3 != zen4
