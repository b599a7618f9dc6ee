"""The C build cache: a library is rebuilt when its source or a header it includes changes."""
import ctypes

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
