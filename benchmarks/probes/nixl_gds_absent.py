"""How NIXL 1.5.1's GPU-storage backends fail on a machine without GPU / cuFile.

  PYTHONPATH=/work/nixl-site NIXL_LOG_LEVEL=DEBUG python3 nixl_gds_absent.py
Tries get_plugin_params and create_backend for GDS, GDS_MT (and OBJ, LIBFABRIC, GPUNETIO for
comparison); prints the exception type and text. The plugin .so files need libcufile.so.0
(GDS, GDS_MT) which the wheel does not ship.
"""
import ctypes.util

from nixl_cu13._api import nixl_agent, nixl_agent_config

ag = nixl_agent("G", nixl_agent_config(backends=[]))
print("plugins listed:", ag.get_plugin_list())
print("libcufile found by ctypes:", ctypes.util.find_library("cufile"))
for b in ("GDS", "GDS_MT", "GPUNETIO", "LIBFABRIC", "OBJ", "POSIX"):
    try:
        p = ag.agent.getPluginParams(b)
        pp = f"params ok {p}"
    except Exception as e:
        pp = f"getPluginParams {type(e).__name__}: {e}"
    try:
        ag.create_backend(b, {})
        cb = "create_backend OK"
    except Exception as e:
        cb = f"create_backend {type(e).__name__}: {e}"
    print(f"{b:10s} {pp} | {cb}")
