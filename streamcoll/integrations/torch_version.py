"""The torch releases streamcoll supports, and the refusal below them.

The floor is torch 2.10 (with Python 3.10, the oldest Python torch 2.10
ships for): the oldest torch on which the version matrix
(``scripts/matrix.sh``, docs/versions.md) passes. Below it, measured on the
CPU against gloo in the same venv:

- torch 2.9: ``torch.compile`` dead-code-eliminates an in-place custom op
  whose result nobody reads (its ``auto_functionalized`` form is not kept by
  ``torch.fx.node.has_side_effect`` before 2.10), so one rank could skip a
  collective its peers run;
- torch 2.7: FSDP2 and DTensor on a streamcoll group give values other than
  gloo's, an aborted group's next collective hangs, and compile of a
  PreMulSum recompiles per factor until ``fullgraph=True`` fails;
- torch <= 2.6: C++ loses a Python ``dist._Work`` subclass's override once
  Python drops the object, so DDP's constructor and DTensor's
  ``full_tensor()`` hang (fixed upstream early 2025); torch 2.4 also cannot
  import the package's custom ops with string annotations (fixed here).

``pip`` refuses such a torch (setup.cfg's ``torch>=2.10``); where one is there
anyway (``--no-deps``, an image's own torch), the features above refuse at
the call with :class:`TorchVersionError` naming the release, rather than hang
or return wrong values: ``backend="streamcoll"`` at ``init_process_group``
(and any group torch creates with it) and a streamcoll collective inside
``torch.compile``. The direct API (a Communicator and ``streamcoll.all_reduce``
run eagerly) has no torch floor of its own.
"""
import re
from typing import Optional, Tuple

import torch

__all__ = ["TORCH_FLOOR", "TorchVersionError", "torch_release", "refusal", "require_torch"]

TORCH_FLOOR: Tuple[int, int] = (2, 10)


class TorchVersionError(RuntimeError):
    """A feature called on a torch older than it needs; the message names both."""


def torch_release(version: Optional[str] = None) -> Tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)`` (``"2.12.0a0+git..."`` -> ``(2, 12)``)."""
    version = torch.__version__ if version is None else version
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"version: not a torch release: {version!r}")
    return int(m.group(1)), int(m.group(2))


def _supported(version: Optional[str] = None) -> bool:
    """Whether ``version`` (default: the running torch's) is at or above the
    floor; a version string that names no release (a local build's
    ``"local"``) counts as supported: the direct API has no floor, and an
    import must not fail on a name."""
    try:
        return torch_release(version) >= TORCH_FLOOR
    except ValueError:
        return True


SUPPORTED: bool = _supported()


def refusal(feature: str, why: str, version: Optional[str] = None) -> Optional[str]:
    """The error message for ``feature`` on ``version`` (default: the running
    torch's), or None where it is at or above the floor."""
    version = torch.__version__ if version is None else version
    if _supported(version):
        return None
    floor = "%d.%d" % TORCH_FLOOR
    return (f"{feature} needs torch >= {floor}, this is torch {version}: {why}. "
            f"Install torch>={floor} (docs/versions.md lists the tested releases).")


def require_torch(feature: str, why: str, version: Optional[str] = None) -> None:
    """Raise :class:`TorchVersionError` if ``version`` (default: the running
    torch's) is below the floor."""
    msg = refusal(feature, why, version)
    if msg is not None:
        raise TorchVersionError(msg)
