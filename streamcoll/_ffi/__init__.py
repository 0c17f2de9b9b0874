"""The binding layer: cffi in ABI mode (``ffi.dlopen``), one module per native
library. Nothing here imports torch; libraries load on first use, so importing
streamcoll works on a machine that has neither."""
