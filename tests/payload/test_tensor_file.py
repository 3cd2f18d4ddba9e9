"""tensor_file.write_safetensors: what it writes is what safetensors' own reader reads back, for
every dtype a training state holds, scalars and empty tensors included."""

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.tensor_file import DTYPES, write_safetensors


def test_safetensors_reads_back_every_dtype_shape_and_value(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {f"{dtype}".removeprefix("torch."): (torch.randn(3, 5, generator=g) * 50).to(dtype) for dtype in DTYPES}
    tensors |= {"step": torch.tensor(7.0), "empty": torch.empty(0, 4), "ünïcode name": torch.arange(3)}
    write_safetensors(tmp_path / "t.safetensors", tensors)
    back = load_file(str(tmp_path / "t.safetensors"))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name], tensor)
    header = int.from_bytes((tmp_path / "t.safetensors").read_bytes()[:8], "little")
    assert header % 8 == 0  # the tensors' data starts aligned


def test_a_strided_view_is_refused_rather_than_written_wrong(tmp_path):
    with pytest.raises(ValueError, match="only contiguous host tensors"):
        write_safetensors(tmp_path / "t.safetensors", {"t": torch.arange(12.0).view(3, 4).t()})
