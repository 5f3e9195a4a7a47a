"""What the ranks of the multi-process tests share: running one case and saving every
result so far where the parent process reads them."""

import json
import os
import time
import traceback


def run_case(results, name, case, path):
    """Runs case() (a dict of what it saw) and keeps results[name] = {"ok", its fields or the
    "traceback", "seconds"}; then writes every result so far to `path`, atomically, since the
    parent may read the file at any time (or find a rank that died mid-way)."""
    start = time.monotonic()
    try:
        results[name] = {"ok": True, **case()}
    except Exception:  # noqa: BLE001 - reported to the parent
        results[name] = {"ok": False, "traceback": traceback.format_exc()}
    results[name]["seconds"] = time.monotonic() - start
    with open(path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(path + ".tmp", path)
