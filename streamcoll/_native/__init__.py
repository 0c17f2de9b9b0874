"""The C declarations cffi parses (``nccl.h``, ``oneccl.h``), shipped as
package data so a wheel or sdist carries them. A package (not a bare data
folder) so setuptools' discovery includes it; nothing to import here.
``native/abi_check.c`` in the source tree checks these same files against
the real headers (tests/binding/test_abi.py)."""
