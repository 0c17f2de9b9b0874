"""The binding: cffi in ABI mode, one module per native library (nccl, oneccl, cudart), the ABI
check and the exception family. Nothing here imports torch; libraries load on first use."""
