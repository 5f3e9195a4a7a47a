"""Where the KVBM_EXT_DEBUG lines go: the logging logger "kvbm_ext".

While the environment variable KVBM_EXT_DEBUG is set (to anything but "" or
"0"; it is read at every call), the extension calls emit() once per GPU copy
call, naming the path the call took and why.  Otherwise no Python code runs.

Each line is a DEBUG record of the logger "kvbm_ext", handled whatever the
loggers' levels (the variable is the switch): the application's handlers get
it through the usual propagation, and a filter on the logger, or
`logging.getLogger("kvbm_ext").disabled = True`, silences it.  Unless one of
those handlers already writes to stderr, the line is also written there as
"kvbm_ext: <message>", so it shows without any logging configuration and
never twice.
"""

import logging
import os
import sys

logger = logging.getLogger("kvbm_ext")


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when the record comes (a redirection, pytest's capture)."""

    def __init__(self):
        logging.Handler.__init__(self)
        self.setFormatter(logging.Formatter("kvbm_ext: %(message)s"))

    @property
    def stream(self):
        return sys.stderr


_stderr = _StderrHandler()


def _printed_to_stderr(record):
    """Whether a handler on the record's way up the logger tree writes it to stderr."""
    node = logger
    while node is not None:
        for handler in node.handlers:
            if (isinstance(handler, logging.StreamHandler) and record.levelno >= handler.level
                    and getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)):
                return True
        node = node.parent if node.propagate else None
    return False


def enabled():
    """Whether KVBM_EXT_DEBUG asks for the lines now (the Python side's switch)."""
    return os.environ.get("KVBM_EXT_DEBUG", "") not in ("", "0")


def emit(message):
    """One KVBM_EXT_DEBUG line (called by the extension)."""
    record = logger.makeRecord(logger.name, logging.DEBUG, "kvbm_ext._C", 0, message, None, None)
    if logger.disabled:
        return
    kept = logger.filter(record)  # False, True, or (Python 3.12+) a record to use instead
    if not kept:
        return
    if isinstance(kept, logging.LogRecord):
        record = kept
    logger.callHandlers(record)
    if not _printed_to_stderr(record):
        _stderr.handle(record)
