"""KVBM_EXT_DEBUG lines are records of the logging logger "kvbm_ext" (kvbm_ext/_debug.py):
on stderr as "kvbm_ext: <message>" without any logging configuration, through the
application's handlers when it has some, never twice on stderr, silenced with the logger.
The GPU tests check that a real call's line arrives that way, once, and that a failing
handler does not change the call's outcome."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvbm_ext
from kvbm_ext import _debug
from support import REPO_ROOT


def emit_in_fresh_python(setup, tmp_path):
    """Runs `setup` then _debug.emit("hello") in a new interpreter (logging unconfigured until
    `setup` configures it); returns (stdout, stderr)."""
    script = "import logging, sys\nfrom kvbm_ext import _debug\n" + textwrap.dedent(setup) + '\n_debug.emit("hello")\n'
    env = dict(os.environ, PYTHONPATH=REPO_ROOT)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout, run.stderr


def test_without_logging_configuration_the_line_goes_to_stderr(tmp_path):
    assert emit_in_fresh_python("", tmp_path) == ("", "kvbm_ext: hello\n")


def test_an_application_handler_on_stderr_prints_it_once(tmp_path):
    """basicConfig at the default WARNING level: the variable asked for the line, so it is
    handled (not dropped for its DEBUG level), in the application's format, once."""
    assert emit_in_fresh_python("logging.basicConfig()", tmp_path) == ("", "DEBUG:kvbm_ext:hello\n")


def test_an_application_log_file_gets_it_and_stderr_too(tmp_path):
    out, err = emit_in_fresh_python(f"logging.basicConfig(filename={str(tmp_path / 'app.log')!r})", tmp_path)
    assert (out, err) == ("", "kvbm_ext: hello\n")
    assert (tmp_path / "app.log").read_text() == "DEBUG:kvbm_ext:hello\n"


def test_a_handler_on_the_kvbm_ext_logger_gets_it(tmp_path):
    out, err = emit_in_fresh_python("""
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        logging.getLogger("kvbm_ext").addHandler(handler)
        """, tmp_path)
    assert (out, err) == ("kvbm_ext DEBUG hello\n", "kvbm_ext: hello\n")


@pytest.mark.parametrize("silence", ['logging.getLogger("kvbm_ext").disabled = True',
                                     'logging.getLogger("kvbm_ext").addFilter(lambda record: False)'])
def test_the_logger_silences_it(tmp_path, silence):
    assert emit_in_fresh_python("logging.basicConfig()\n" + silence, tmp_path) == ("", "")


def test_caplog_sees_the_record(caplog, capsys, monkeypatch):
    # The loggers' levels say WARNING: the variable is the switch, so the record still comes.
    monkeypatch.setattr(logging.getLogger(), "level", logging.WARNING)
    monkeypatch.setattr(logging.getLogger("kvbm_ext"), "level", logging.WARNING)
    _debug.emit("block_to_universal: path kernel (test)")
    (record,) = [r for r in caplog.records if r.name == "kvbm_ext"]
    assert record.levelno == logging.DEBUG and record.getMessage() == "block_to_universal: path kernel (test)"
    assert capsys.readouterr().err == "kvbm_ext: block_to_universal: path kernel (test)\n"


# --------------------------------------------------------------------------
# GPU: the extension's lines take that way.
# --------------------------------------------------------------------------

def gpu_case():
    """A block stack of 2 layers on the GPU and its operational block."""
    blocks = [[torch.randn(4, 2, 8, device="cuda") for _ in range(4)]]
    operationals = [torch.empty(2, 2, 4 * 2 * 8, device="cuda")]
    return blocks, operationals


@pytest.mark.gpu
def test_gpu_call_logs_one_record(monkeypatch, caplog):
    blocks, operationals = gpu_case()
    monkeypatch.delenv("KVBM_EXT_DEBUG", raising=False)
    with caplog.at_level(logging.DEBUG, logger="kvbm_ext"):
        kvbm_ext.block_to_operational(blocks, operationals)
        torch.cuda.synchronize()
        assert not [r for r in caplog.records if r.name == "kvbm_ext"], "a line without KVBM_EXT_DEBUG"
        monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
        kvbm_ext.block_to_operational(blocks, operationals)
        torch.cuda.synchronize()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvbm_ext"]
    assert len(lines) == 1 and lines[0].startswith("block_to_operational: path "), lines


@pytest.mark.gpu
def test_gpu_call_survives_a_failing_handler(monkeypatch):
    """A handler that raises: the call still succeeds and moves its bytes, the error goes to
    sys.unraisablehook, and no exception is left set."""
    class Failing(logging.Handler):
        def emit(self, record):    # raises out of logging (a StreamHandler would catch it)
            raise RuntimeError("handler broke")

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    logger = logging.getLogger("kvbm_ext")
    handler = Failing()
    logger.addHandler(handler)
    try:
        monkeypatch.setenv("KVBM_EXT_DEBUG", "1")
        blocks, operationals = gpu_case()
        kvbm_ext.block_to_operational(blocks, operationals)
        torch.cuda.synchronize()
    finally:
        logger.removeHandler(handler)
    expected = torch.stack(blocks[0]).reshape(2, 2, -1)
    assert torch.equal(operationals[0], expected)
    assert len(seen) == 1 and isinstance(seen[0].exc_value, RuntimeError), seen
