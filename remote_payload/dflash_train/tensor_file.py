"""Writing tensors that are already in host memory as a safetensors file, without a copy.

safetensors' own `save_file` first builds the whole file as bytes in memory, holding the GIL while
it copies; a checkpoint's files are written from several threads at once (one file each), so each
writes its tensors' memory straight to the file with os.write, which lets go of the GIL. On an H200
box, 12.6 GB went into the page cache at 2.6-3.8 GB/s from one thread and 13-18 GB/s from 4-8
(bench/stop_bench.py). The layout is safetensors' own (an 8-byte little-endian header length, the
JSON header padded with spaces to 8 bytes, the tensors back to back), read by its `load_file`."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
PIECE = 1 << 26  # bytes per os.write: large enough for full speed, small enough to stay interruptible


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes (it must be a contiguous CPU tensor: a host copy is)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"a {tensor.device} tensor of strides {tensor.stride()}: only contiguous host tensors")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (contiguous, in host memory) to `path` in the safetensors format."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(struct.pack("<Q", len(text)) + text))
        for tensor in tensors.values():
            data = _bytes_of(tensor)
            for start in range(0, len(data), PIECE):
                _write_all(fd, data[start : start + PIECE])
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]
