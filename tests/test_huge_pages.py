"""Large host tensors in transparent huge pages once vacpack is imported, and a warning where a
process decided otherwise before it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from vacpack import huge_pages

# A 64 MiB tensor allocated right after `import vacpack`, and the bytes then in huge pages.
ALLOCATE_AND_MEASURE = """
import vacpack, torch
from vacpack.huge_pages import huge_page_bytes
tensor = torch.ones(16 << 20)
print(huge_page_bytes())
"""
TENSOR_BYTES = 64 << 20


def _huge_bytes_after_import() -> int:
    environment = {k: v for k, v in os.environ.items() if k != huge_pages.TORCH_HUGE_PAGES_ENV}
    finished = subprocess.run(
        [sys.executable, "-c", ALLOCATE_AND_MEASURE],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 0, finished.stderr
    return int(finished.stdout.split()[-1])


def test_large_tensors_get_huge_pages() -> None:
    mode = huge_pages.transparent_huge_pages_mode()
    if mode not in ("madvise", "always") or huge_pages.huge_page_bytes() is None:
        pytest.skip(f"transparent huge pages are {mode or 'not available'} on this machine")
    # A 2 MiB page may be left at either end of the block.
    assert _huge_bytes_after_import() >= TENSOR_BYTES - (4 << 20)


def test_the_users_own_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(huge_pages.TORCH_HUGE_PAGES_ENV, "0")
    huge_pages.request_huge_pages()
    assert os.environ[huge_pages.TORCH_HUGE_PAGES_ENV] == "0"
    monkeypatch.delenv(huge_pages.TORCH_HUGE_PAGES_ENV)
    huge_pages.request_huge_pages()
    assert os.environ[huge_pages.TORCH_HUGE_PAGES_ENV] == "1"


def test_weights_left_in_small_pages_are_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(huge_pages.TORCH_HUGE_PAGES_ENV, "1")
    monkeypatch.setattr(huge_pages, "transparent_huge_pages_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "huge_page_bytes", lambda: 0)
    monkeypatch.setattr(huge_pages, "_num_models_loaded", 0)  # this process's first model
    big = huge_pages.MIN_CHECKED_WEIGHT_BYTES
    with caplog.at_level(logging.WARNING, logger="vacpack.huge_pages"):
        assert huge_pages.check_weights_in_huge_pages(big // 2)  # too small to tell
        assert not caplog.records
        monkeypatch.setattr(huge_pages, "_num_models_loaded", 0)
        assert not huge_pages.check_weights_in_huge_pages(big)
    assert "not in huge pages" in caplog.text and "import vacpack first" in caplog.text
    # A later model in the same process may reuse an earlier one's freed (small-page) memory:
    # that is no import-order mistake, and no warning.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vacpack.huge_pages"):
        assert not huge_pages.check_weights_in_huge_pages(big)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "earlier in this process" in caplog.text
    monkeypatch.setattr(huge_pages, "huge_page_bytes", lambda: big)
    assert huge_pages.check_weights_in_huge_pages(big)
    # Turned off by the user, or off in the kernel: nothing to say.
    caplog.clear()
    monkeypatch.setattr(huge_pages, "huge_page_bytes", lambda: 0)
    monkeypatch.setenv(huge_pages.TORCH_HUGE_PAGES_ENV, "0")
    assert not huge_pages.check_weights_in_huge_pages(big)
    monkeypatch.setenv(huge_pages.TORCH_HUGE_PAGES_ENV, "1")
    monkeypatch.setattr(huge_pages, "transparent_huge_pages_mode", lambda: "never")
    assert not huge_pages.check_weights_in_huge_pages(big)
    assert not caplog.records
