"""The safetensors file format: its dtype names, a file read as memory-mapped arrays, and the header
of a file to write (8-byte length, then JSON padded with spaces to a multiple of 8)."""

from __future__ import annotations

import json
import math
import pathlib
import struct
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """{name: read-only memory-mapped array} of one .safetensors file."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    start = 8 + header_len
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path.name}: tensor {name!r} has {end - begin} bytes for {shape}")
        out[name] = raw[start + begin : start + end].view(dtype).reshape(shape)
    return out


def safetensors_header(entries: Sequence[tuple[str, tuple[int, ...], np.dtype]]) -> bytes:
    """A safetensors header (8-byte length, JSON padded with spaces to a multiple of 8)."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        doc[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
