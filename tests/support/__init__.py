"""Shared pieces of the kvbm_ext tests, imported as `support.<module>`:

  references  plain PyTorch references of every layout move (bit-exact integer views)
  builders    random cases, placements, caches and their buffers, parameter ids
  producers   objects that offer exactly one array or stream protocol
  asserts     poison, byte-for-byte comparison, "call and check" and "rejected" helpers
  devices     the device parameter, waiting for the GPU, stream-ordering probes
"""

import os

# The checkout's root (the tests' conftest puts it first on sys.path).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
