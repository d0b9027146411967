"""Programmatic dependent launch: where the launch option is given."""

import torch
from helpers.kernel_cases import ON_GPU


def test_programmatic_dependent_launch_only_where_it_exists(monkeypatch):
    """PDL launch options: never for CPU tensors (nor under the interpreter), switched off by H3GEN_PDL=0, and on
    a GPU only from compute capability 9.0."""
    from h3gen.kernels import _pdl

    assert _pdl.pdl_launch(torch.zeros(1)) == {} and not _pdl.pdl_flag({})
    if ON_GPU:
        expected = {"launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 else {}
        assert _pdl.pdl_launch(torch.zeros(1, device="cuda")) == expected
        monkeypatch.setenv("H3GEN_PDL", "0")
        assert _pdl.pdl_launch(torch.zeros(1, device="cuda")) == {}
    assert _pdl.pdl_flag({"launch_pdl": True})
