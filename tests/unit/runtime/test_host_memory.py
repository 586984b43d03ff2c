"""keep_freed_host_memory: the glibc settings it asks for and the user's own settings it keeps.

Expected parameter numbers are glibc's ``malloc.h`` (``M_TRIM_THRESHOLD`` -1, ``M_MMAP_THRESHOLD`` -3); 32 MiB is the
largest mmap threshold glibc accepts on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``, mallopt(3)).
"""

from __future__ import annotations

import sys

import pytest

from library.runtime import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings only on Linux")


class FakeLibc:
    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return self.result

        self.mallopt = mallopt


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda name: fake)
    for name in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    return fake


def test_sets_mmap_and_trim_thresholds(libc):
    assert host_memory.keep_freed_host_memory() is True
    assert libc.calls == [(-3, 32 * 1024 * 1024), (-1, 2147483647)]


def test_huge_pages_on_unless_the_user_said_otherwise(libc, monkeypatch):
    host_memory.use_huge_pages()
    assert host_memory.os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    host_memory.use_huge_pages()
    assert host_memory.os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_keeps_the_users_settings(libc, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    host_memory.keep_freed_host_memory()
    assert libc.calls == [(-3, 32 * 1024 * 1024)]


def test_reports_a_refused_setting(libc):
    libc.result = 0  # mallopt returns 0 on error
    assert host_memory.keep_freed_host_memory() is False
