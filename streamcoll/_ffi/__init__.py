"""The binding layer: cffi in ABI mode (``ffi.dlopen``), one module per native
library (``nccl``, ``oneccl``; ``_common`` holds what they share, ``abi`` the
Python half of the ABI check, used by tests/test_abi.py only). Nothing here
imports torch; libraries load on first use, so importing streamcoll works on a
machine that has neither."""
