"""The torch floor (issue 43): below torch 2.10 the features that hang or
give wrong values there refuse at the call, naming the release
(streamcoll/integrations/torch_version.py says what was measured below it). Here the
running torch is made to look older; scripts/matrix.sh runs the suite on
the real releases of the declared range."""
from __future__ import annotations

import configparser
import os

import pytest
import torch

import streamcoll
from streamcoll.integrations import torch_version
from streamcoll.integrations.torch_version import TORCH_FLOOR, TorchVersionError, require_torch, torch_release

from conftest import ROOT


def test_release_of_torch_version_strings():
    assert torch_release("2.11.0+cu130") == (2, 11)
    assert torch_release("2.12.0a0+gitabc") == (2, 12)
    assert torch_release("2.9.1") == (2, 9)
    with pytest.raises(ValueError, match="not a torch release"):
        torch_release("nightly")


def test_the_running_torch_is_supported():
    assert torch_version.SUPPORTED and torch_release() >= TORCH_FLOOR
    require_torch("anything", "no reason")  # no error


def test_below_the_floor_the_error_names_both_releases():
    with pytest.raises(TorchVersionError, match=r"^x needs torch >= 2\.10, this is torch 2\.9\.1\+cu128: why\. "
                                                r"Install torch>=2\.10"):
        require_torch("x", "why", "2.9.1+cu128")


def test_the_floor_is_setup_cfgs_and_the_readmes():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    floor = "%d.%d" % TORCH_FLOOR
    assert f"torch>={floor}" in cfg["options"]["install_requires"].split()
    assert cfg["options"]["python_requires"].strip() == ">=3.10"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert f"torch >= {floor}" in readme and "Python >= 3.10" in readme


def test_process_group_refuses_an_older_torch(monkeypatch):
    from streamcoll.integrations.process_group import create_process_group
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(TorchVersionError, match=r'backend="streamcoll" needs torch >= 2\.10, this is torch 2\.9\.1'):
        create_process_group(None, 0, 1)  # refused before the store is touched


def test_compile_refuses_an_older_torch(monkeypatch):
    import torch._dynamo
    from streamcoll.integrations import custom_ops
    monkeypatch.setattr(custom_ops, "_COMPILE_REFUSAL", torch_version.refusal(
        "a streamcoll collective inside torch.compile", "why", "2.9.1+cu128"))

    def fn(x):
        streamcoll.barrier()
        return x + 1

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match=r"inside torch.compile needs torch >= 2\.10, this is torch 2\.9\.1"):
            torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
    finally:
        torch._dynamo.reset()
