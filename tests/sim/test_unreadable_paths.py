"""Paths a user may not even look at (EACCES from stat, as for a non-root user under /root):
every pre-run path check answers with one line instead of a PermissionError traceback. The
tests run as root, where stat never fails, so the error is injected into `Path.stat`."""

from __future__ import annotations

import errno
import pathlib

import pytest


@pytest.fixture
def forbidden(monkeypatch, tmp_path):
    """A directory whose entries raise PermissionError on stat; returns its path."""
    base = tmp_path / "priv"
    real = pathlib.Path.stat

    def stat(self, *args, **kwargs):
        if str(self).startswith(str(base) + "/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    return base


def test_check_trace_out(forbidden):
    from sim.cli import _trace_dir

    with pytest.raises(ValueError, match="cannot use .*: Permission denied"):
        _trace_dir(str(forbidden / "traces"))


def test_docs_root(forbidden):
    from sim.docs_cli import check_root

    assert "cannot be used: Permission denied" in check_root(str(forbidden / "r"))


def test_bench_output(forbidden):
    from engine.bench.options import BenchArgError, check_output_path

    with pytest.raises(BenchArgError, match="--json .* cannot be used: Permission denied"):
        check_output_path("--json", str(forbidden / "x.json"))


def test_make_model_out(forbidden):
    from engine.cli_make_model import _check_out

    assert "cannot be used: Permission denied" in _check_out(str(forbidden / "m"))
