"""requirements.txt installs on a GPU machine too: the registry's CUDA torch pins its own triton
(torch 2.13.0 pins triton==3.7.1), and a different triton pin makes pip refuse the whole file
there, while CPU machines, whose local torch build needs no triton, never notice."""

import importlib.metadata
import re

import pytest
from conftest import ROOT

TORCH_NEEDS = re.compile(r"^# torch (\S+) \(CUDA, Linux\) requires (triton==\S+)$", re.M)


def pins():
    text = (ROOT / "requirements.txt").read_text()
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", text, re.M))
    return text, found


def test_triton_pin_is_the_one_the_cuda_torch_requires():
    text, found = pins()
    table = TORCH_NEEDS.search(text)
    assert table, "requirements.txt must say which triton the pinned CUDA torch requires"
    torch_version, triton_requirement = table.groups()
    assert found["torch"] == torch_version, "the torch pin changed: look up its triton pin and update the note"
    assert f"triton=={found['triton']}" == triton_requirement


def test_installed_torch_agrees_with_the_triton_pin():
    """Where the installed torch is a registry build that names a triton (a GPU machine), the
    pin must be what it names; CPU builds name none."""
    _, found = pins()
    version = importlib.metadata.version("torch")
    requires = importlib.metadata.requires("torch") or []
    named = [r.split(";")[0].strip() for r in requires if re.match(r"triton\b", r)]
    if version.split("+")[0] != found["torch"] or not named:
        pytest.skip(f"installed torch {version} is not the pinned registry build that names a triton")
    assert named == [f"triton=={found['triton']}"]
