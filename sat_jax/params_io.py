"""Server weights on disk: the policy's params alone, in the formats both ends share.

The trainer writes a weights version with `save_weights` and the rollout server's `UpdateWeights`
restores it with `load_params` (docs/DESIGN.md §6, §7), which reads either format:

- **orbax** (`save_params`): an orbax `StandardCheckpointer` directory holding the params as a
  plain nested dict, `nnx.to_pure_dict(nnx.state(model))`. Every process of a multi-process
  trainer writes its own shards; any path orbax reaches (``gs://...`` URLs too).
- **flat** (`save_flat`): one process, a local path: `FLAT_INDEX` (JSON: each leaf's tree path,
  dtype, shape and byte range, and the CRC-32 of the data) and `FLAT_DATA` (the leaves' bytes, one
  after the other), written into a temporary directory and renamed into place: fsynced first
  (``durable=True``), or not, for a push on the critical path, whose reader checks the CRC where
  a crash of the machine may have come between the write and the read (``verify=True``: a
  restarting server). Orbax's fixed cost is tens of
  milliseconds per save or restore whatever the size (about 50 ms to save and 16 ms to restore
  0.5 MB here), which at a small model's step time sits on the critical path of every push; the
  flat files take a few milliseconds. `save_weights` picks flat where it can (one process, a local
  path) and orbax otherwise.
- **sharded** (`save_shards`, `finish_shards`): several processes, a local path every process
  reaches: each process writes its own shards' bytes and a JSON index of them in files of its
  own, and process 0, once every process's part is written, names the parts in `SHARDS_INDEX`.
  No barrier, lock or collective, so a background thread writes them while the process
  checkpoints with orbax (the trainer learns that every part is written from its distributed
  runtime's key-value store: `train.weight_sync.save_version`).

`load_params` tells the formats apart by `FLAT_INDEX` and `SHARDS_INDEX`.

A pre-quantized push (a tree of `sat_jax.quant.QTensor` leaves: 8-bit values and float32 scales,
for servers with `server.weight_dtype` int8 or fp8) is written flat or sharded, never orbax; its
index records the format as ``"weight_dtype"`` (`stored_weight_dtype` reads it; an index without
the key is full precision, as every version written before it was).

Local paths are made absolute (orbax needs them so); URLs such as ``gs://...`` reach orbax
unchanged.

`ORBAX_LOCK` serialises every orbax save and restore of the process, these and the trainer's
checkpoints alike (flat and sharded weights do not take it): orbax's completion signalling is not safe across concurrent operations of one
process (a save then waits for a signal that never comes, until its 300 s timeout).

Importing this module also works around a leak on orbax's write and read paths
(`leak_free_kvstore_specs`): every array saved or restored otherwise keeps ~220 bytes of Python
strings for good, so a trainer pushing weights every step grows without bound (docs/DESIGN.md §7.3).
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import math
import os
import shutil
import threading
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

from sat_jax import quant

# One orbax save or restore at a time in this process (see the module docstring).
ORBAX_LOCK = threading.Lock()


def save_params(path: str | os.PathLike[str], params: Any) -> None:
    """Writes `params` as a weights checkpoint at `path`, replacing one already there.

    With several JAX processes every process calls it with the same `path` (on storage they all
    reach) and writes only the shards of its own devices (replica 0 of each); process 0 finalizes
    the checkpoint after a barrier of the JAX distributed client (not a device collective, so a
    background thread may save while the main thread runs steps). No process gathers the params.

    Args:
      path: a local directory (made absolute) or a URL.
      params: a pytree of arrays: jax arrays (any sharding and memory kind) or NumPy arrays (taken
        as replicated: process 0 writes them).
    """
    everyone = ocp.options.MultiprocessingOptions(
        primary_host=0, active_processes=set(range(jax.process_count()))
    )
    with ORBAX_LOCK, ocp.StandardCheckpointer(multiprocessing_options=everyone) as checkpointer:
        checkpointer.save(absolute(path), params, force=True)
        checkpointer.wait_until_finished()


def save_weights(path: str | os.PathLike[str], params: Any, *, durable: bool = True) -> str:
    """Writes a weights version at `path` in the cheapest format the servers can read: flat
    (`save_flat`, fsynced or not as `durable` says) with one JAX process and a local path, orbax
    (`save_params`) otherwise (several processes each write their own shards; a URL). Returns the
    format written, "flat" or "orbax". Several processes and a local path should rather write
    sharded weights (`save_shards` and `finish_shards`, which need no barrier).

    Raises:
      ValueError: pre-quantized params (`quant.QTensor` leaves) that would go to orbax."""
    if flat_possible(path):
        save_flat(path, params, durable=durable)
        return "flat"
    fmt = quant.tree_format(params)
    if quant.is_quantized(fmt):
        raise ValueError(
            f"pre-quantized ({fmt}) weights are written flat or sharded, not to orbax "
            f"({os.fspath(path)!r}): push full precision there"
        )
    save_params(path, params)
    return "orbax"


def weights_format(path: str | os.PathLike[str]) -> str:
    """The format a weights version at `path` is written in by this job: "flat" (one process, a
    local path), "shards" (several processes, a local path every process reaches) or "orbax" (a
    URL)."""
    if "://" in os.fspath(path):
        return "orbax"
    return "flat" if jax.process_count() == 1 else "shards"


def flat_possible(path: str | os.PathLike[str]) -> bool:
    """Whether `save_flat` may write `path`: this is the only JAX process (it holds every shard)
    and `path` is local."""
    return jax.process_count() == 1 and "://" not in os.fspath(path)


FLAT_INDEX = "flat_weights.json"
FLAT_DATA = "flat_weights.bin"
FLAT_FORMAT = "sat_jax.flat_weights/1"
_TMP = itertools.count()


def save_flat(path: str | os.PathLike[str], params: Any, *, durable: bool = True) -> None:
    """Writes `params` as flat weights at `path` (a local directory, replaced if there): the
    leaves' bytes in `FLAT_DATA` and their tree paths, dtypes, shapes and byte ranges, and the
    CRC-32 of `FLAT_DATA`, in `FLAT_INDEX` (and, for pre-quantized params, their format as
    ``"weight_dtype"``: `stored_weight_dtype`). Written into a temporary directory beside it, then
    renamed into place, so a reader never sees a partial version while the machine stays up.

    Args:
      path: a local directory.
      params: a pytree of arrays, each fully held by this process (NumPy arrays, or jax arrays
        in any memory kind).
      durable: fsync the files before the rename and the parent directory after it, so the
        version survives a crash of the machine once this returns. False skips the fsyncs (they
        were most of a small push's save): after a crash of the machine the directory may then
        be missing or hold bytes that were never written, which a reader that may follow one
        detects with ``load_flat(..., verify=True)`` (the CRC).

    Raises:
      ValueError: `path` is a URL, or several JAX processes run (use `save_params`).
    """
    if not flat_possible(path):
        raise ValueError(
            f"flat weights need one JAX process and a local path (got {jax.process_count()} "
            f"processes, path {os.fspath(path)!r}); use save_params"
        )
    fmt = quant.tree_format(params)
    final = absolute(path)
    tmp = f"{final}.tmp-{os.getpid()}-{next(_TMP)}"
    os.makedirs(tmp)
    try:
        leaves, offset, crc = [], 0, 0
        with open(os.path.join(tmp, FLAT_DATA), "wb") as f:
            for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                array = np.ascontiguousarray(np.asarray(leaf))
                data = array.reshape(-1).view(np.uint8).data
                f.write(data)
                crc = zlib.crc32(data, crc)
                leaves.append(
                    {
                        "path": _leaf_name(key),
                        "dtype": str(array.dtype),
                        "shape": list(array.shape),
                        "offset": offset,
                        "nbytes": array.nbytes,
                    }
                )
                offset += array.nbytes
            _flush(f, durable)
        index = {"format": FLAT_FORMAT, "leaves": leaves, "crc32": crc}
        if quant.is_quantized(fmt):
            index["weight_dtype"] = fmt
        with open(os.path.join(tmp, FLAT_INDEX), "w") as f:
            json.dump(index, f)
            _flush(f, durable)
        if os.path.lexists(final):  # a re-push of the version replaces it, as orbax's force=True
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        _fsync_dir(os.path.dirname(final))


SHARDS_INDEX = "sharded_weights.json"
SHARDS_FORMAT = "sat_jax.sharded_weights/1"
_SHARDS_PREFIX = "shards-p"


def save_shards(
    path: str | os.PathLike[str], params: Any, *, durable: bool = True, process: int | None = None
) -> str:
    """Writes this process's part of a sharded weights version at `path` and returns the name of
    its index file; `finish_shards` (process 0, once every process's part is written) makes the
    version readable.

    The part is the replica-0 shards of this process's devices (NumPy leaves, taken as
    replicated: process 0 alone), their bytes one after the other in
    ``shards-p<PROCESS>-<ID>.bin`` and, in ``shards-p<PROCESS>-<ID>.json``, each piece's leaf tree
    path, dtype, global shape, index (``[start, stop]`` per dimension) and byte range, and the
    file's CRC-32. Each file is written under a temporary name and renamed, the index last;
    nothing is shared with another process or another save, so no barrier, lock or collective
    is taken: a background thread may save while the loop steps and another thread checkpoints.

    Args:
      path: a local directory every process (and server) reaches; made if missing.
      params: a pytree of arrays: jax arrays (any sharding and memory kind) or NumPy arrays.
      durable: fsync both files before their renames (see `save_flat`).
      process: the writing process's index (default ``jax.process_index()``): it names the files,
        and only process 0 writes NumPy leaves.

    Raises:
      ValueError: `path` is a URL.
    """
    if "://" in os.fspath(path):
        raise ValueError(f"sharded weights need a local path (got {os.fspath(path)!r})")
    final = absolute(path)
    os.makedirs(final, exist_ok=True)
    process = jax.process_index() if process is None else process
    name = f"{_SHARDS_PREFIX}{process}-{os.getpid()}-{next(_TMP)}"
    pieces, offset, crc = [], 0, 0
    data_tmp = os.path.join(final, f".{name}.bin.tmp")
    try:
        with open(data_tmp, "wb") as f:
            for key, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                for bounds, data in _own_pieces(leaf, process):
                    array = np.ascontiguousarray(data)
                    raw = array.reshape(-1).view(np.uint8).data
                    f.write(raw)
                    crc = zlib.crc32(raw, crc)
                    pieces.append(
                        {
                            "path": _leaf_name(key),
                            "dtype": str(array.dtype),
                            "shape": list(np.shape(leaf)),
                            "index": bounds,
                            "offset": offset,
                            "nbytes": array.nbytes,
                        }
                    )
                    offset += array.nbytes
            _flush(f, durable)
        os.rename(data_tmp, os.path.join(final, f"{name}.bin"))
        index = {"format": SHARDS_FORMAT, "process": process, "pieces": pieces, "crc32": crc}
        _write_json(os.path.join(final, f"{name}.json"), index, durable)
    except BaseException:
        for leftover in (data_tmp, os.path.join(final, f"{name}.bin")):
            if os.path.lexists(leftover):
                os.remove(leftover)
        raise
    return f"{name}.json"


def finish_shards(
    path: str | os.PathLike[str],
    parts: list[str],
    *,
    durable: bool = True,
    weight_dtype: str = "bfloat16",
) -> None:
    """Makes the sharded weights at `path` readable (process 0, once every process's
    `save_shards` returned): writes `SHARDS_INDEX` naming exactly `parts` (replacing the one there,
    by a rename), then removes the files of earlier saves of the same path that it does not name.
    A pre-quantized version's format (`quant.tree_format` of what the parts hold) is recorded as
    ``"weight_dtype"`` (`stored_weight_dtype`).

    Raises:
      ValueError: a part named is not in `path` (a process wrote elsewhere).
    """
    final = absolute(path)
    for part in parts:
        if not os.path.isfile(os.path.join(final, part)):
            raise ValueError(f"{final}: no {part} (a process's part of the weights)")
    index: dict[str, Any] = {"format": SHARDS_FORMAT, "parts": parts}
    if quant.is_quantized(weight_dtype):
        index["weight_dtype"] = weight_dtype
    _write_json(os.path.join(final, SHARDS_INDEX), index, durable)
    keep = {p.removesuffix(".json") for p in parts}
    for entry in os.listdir(final):
        stem = entry.rsplit(".", 1)[0]
        if entry.startswith(_SHARDS_PREFIX) and stem not in keep:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(final, entry))
    if durable:
        _fsync_dir(final)


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds sharded weights that `finish_shards` made readable."""
    path = os.fspath(path)
    return "://" not in path and os.path.isfile(os.path.join(path, SHARDS_INDEX))


def load_sharded(path: str | os.PathLike[str], like: Any, *, verify: bool = False) -> Any:
    """Restores sharded weights (`save_shards`, `finish_shards`) onto `like`'s structure, dtypes,
    shapes and shardings; each device's shard is copied out of the pieces it overlaps
    (memory-mapped).

    Args:
      path: the directory.
      like: a pytree of jax arrays or `jax.ShapeDtypeStruct`s.
      verify: check each part's data against its CRC-32 first.

    Raises:
      ValueError: not sharded weights, a part's bytes or CRC do not match its index, or a leaf of
        `like` is missing, of another shape or dtype, or not wholly covered by the pieces.
    """
    path = os.fspath(path)
    index = _read_json(os.path.join(path, SHARDS_INDEX))
    if not isinstance(index, dict) or index.get("format") != SHARDS_FORMAT:
        raise ValueError(f"{path}: not sharded weights of format {SHARDS_FORMAT!r}")
    by_leaf: dict[str, list[tuple[dict, np.ndarray]]] = {}
    for part in index["parts"]:
        doc = _read_json(os.path.join(path, part))
        data = os.path.join(path, part.removesuffix(".json") + ".bin")
        size = os.path.getsize(data)
        buffer = np.memmap(data, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        if verify and zlib.crc32(buffer) != doc.get("crc32"):
            raise ValueError(f"{path}: {part}'s data does not match its CRC-32")
        for piece in doc["pieces"]:
            if piece["offset"] + piece["nbytes"] > size:
                raise ValueError(f"{path}: {part}: leaf {piece['path']} is past the data's end")
            by_leaf.setdefault(piece["path"], []).append((piece, buffer))
    flat_like, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    for key, want in flat_like:
        name, shape = _leaf_name(key), tuple(want.shape)
        pieces = by_leaf.get(name, [])
        if not pieces:
            raise ValueError(f"{path}: no leaf {name}")
        arrays = []
        for piece, buffer in pieces:
            if tuple(piece["shape"]) != shape:
                raise ValueError(
                    f"{path}: leaf {name} has shape {piece['shape']} where the params have "
                    f"{list(shape)}"
                )
            dtype = _stored_dtype(piece["dtype"], np.dtype(want.dtype), name, path)
            bounds = [tuple(b) for b in piece["index"]]
            count = math.prod(b - a for a, b in bounds)
            if count * dtype.itemsize != piece["nbytes"]:
                raise ValueError(f"{path}: leaf {name}'s piece {bounds} has the wrong size")
            raw = buffer[piece["offset"] : piece["offset"] + piece["nbytes"]]
            arrays.append((bounds, raw.view(dtype).reshape([b - a for a, b in bounds])))
        if sum(a.size for _, a in arrays) != math.prod(shape):
            raise ValueError(f"{path}: leaf {name}'s pieces do not cover it once")
        out.append(_assembled(shape, arrays, want))
    return jax.tree_util.tree_unflatten(treedef, out)


def _own_pieces(leaf: Any, process: int) -> list[tuple[list[list[int]], Any]]:
    """The (bounds, data) of each piece of `leaf` this process writes: its replica-0 shards of a
    jax array; the whole of any other array on process 0 only."""
    if isinstance(leaf, jax.Array):
        return [
            (_bounds(s.index, leaf.shape), np.asarray(s.data))
            for s in leaf.addressable_shards
            if s.replica_id == 0
        ]
    if process != 0:
        return []
    array = np.asarray(leaf)
    return [([[0, n] for n in array.shape], array)]


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's index (a tuple of slices) as ``[start, stop]`` per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _assembled(shape: tuple[int, ...], pieces: list, like: Any) -> Any:
    """The leaf of `shape` made of `pieces` ((bounds, array) pairs), on `like`'s sharding and
    dtype: each addressable shard gets the overlaps of the pieces with its region."""
    dtype = np.dtype(like.dtype)

    def region(index: tuple) -> np.ndarray:
        want = _bounds(index, shape)
        out = np.empty([b - a for a, b in want], dtype)
        for bounds, array in pieces:
            lo = [max(a, c) for (a, _), (c, _) in zip(want, bounds, strict=True)]
            hi = [min(b, d) for (_, b), (_, d) in zip(want, bounds, strict=True)]
            if any(x >= y for x, y in zip(lo, hi, strict=True)):
                continue
            src = tuple(slice(x - c, y - c) for x, y, (c, _) in zip(lo, hi, bounds, strict=True))
            dst = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, want, strict=True))
            out[dst] = array[src]
        return out

    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(region(tuple(slice(None) for _ in shape)))
    return jax.make_array_from_callback(shape, sharding, region)


def _write_json(path: str, doc: Any, durable: bool) -> None:
    """Writes `doc` at `path` through a temporary name and a rename."""
    tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.tmp-{os.getpid()}-{next(_TMP)}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
            _flush(f, durable)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _flush(f: Any, durable: bool) -> None:
    f.flush()
    if durable:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stored_weight_dtype(path: str | os.PathLike[str]) -> str:
    """The weight format of the version at `path`, as its index records it: "int8" or "fp8" for a
    pre-quantized push (values and scales), any other name as written (the reader refuses what
    it cannot install); "bfloat16" (full precision) when the index names none, and for orbax."""
    path = os.fspath(path)
    for name in (FLAT_INDEX, SHARDS_INDEX):
        if "://" not in path and os.path.isfile(os.path.join(path, name)):
            doc = _read_json(os.path.join(path, name))
            return str(doc.get("weight_dtype", "bfloat16")) if isinstance(doc, dict) else "bfloat16"
    return "bfloat16"


def is_flat(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds flat weights (`save_flat`)."""
    path = os.fspath(path)
    return "://" not in path and os.path.isfile(os.path.join(path, FLAT_INDEX))


def load_flat(path: str | os.PathLike[str], like: Any, *, verify: bool = False) -> Any:
    """Restores flat weights (`save_flat`) onto `like`'s structure, dtypes, shapes and shardings;
    each device gets its own shard, read from the file's bytes (memory-mapped).

    Args:
      path: the directory `save_flat` wrote.
      like: a pytree of jax arrays or `jax.ShapeDtypeStruct`s giving each leaf's shape, dtype and
        sharding.
      verify: check the data against the index's CRC-32 first (one pass over the bytes): for a
        reader that may follow a crash of the machine after a save with ``durable=False``.
        Versions written before the index carried a CRC load unchecked.

    Raises:
      ValueError: the index is not flat weights, does not match `like` (names the first leaf
        that differs), its byte ranges do not fit the data file, or (``verify``) the data's CRC is
        not the index's.
    """
    path = os.fspath(path)
    with open(os.path.join(path, FLAT_INDEX)) as f:
        index = json.load(f)
    if not isinstance(index, dict) or index.get("format") != FLAT_FORMAT:
        raise ValueError(f"{path}: not flat weights of format {FLAT_FORMAT!r}")
    data = os.path.join(path, FLAT_DATA)
    size = os.path.getsize(data)
    entries = index.get("leaves")
    flat_like, treedef = jax.tree_util.tree_flatten_with_path(like)
    if not isinstance(entries, list) or len(entries) != len(flat_like):
        count = len(entries) if isinstance(entries, list) else "no"
        raise ValueError(f"{path}: {count} leaves where the params have {len(flat_like)}")
    buffer = np.memmap(data, np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    if verify and "crc32" in index and zlib.crc32(buffer) != index["crc32"]:
        raise ValueError(
            f"{path}: {FLAT_DATA}'s CRC-32 is not its index's (torn by a crash of the machine?)"
        )
    out, offset = [], 0
    for entry, (key, want) in zip(entries, flat_like, strict=True):
        name, shape = _leaf_name(key), tuple(want.shape)
        if not isinstance(entry, dict) or entry.get("path") != name:
            got = entry.get("path") if isinstance(entry, dict) else entry
            raise ValueError(f"{path}: leaf {got!r} where the params have {name!r}")
        dtype = _stored_dtype(entry.get("dtype"), np.dtype(want.dtype), name, path)
        nbytes = math.prod(shape) * dtype.itemsize
        if entry.get("shape") != list(shape) or entry.get("nbytes") != nbytes:
            raise ValueError(
                f"{path}: leaf {name} has shape {entry.get('shape')} where the params have "
                f"{list(shape)}"
            )
        if entry.get("offset") != offset or offset + nbytes > size:
            raise ValueError(f"{path}: leaf {name}'s bytes are not where {FLAT_DATA} has them")
        array = buffer[offset : offset + nbytes].view(dtype).reshape(shape)
        out.append(_placed(array, want))
        offset += nbytes
    if offset != size:
        raise ValueError(f"{path}: {FLAT_DATA} holds {size} bytes, the leaves {offset}")
    return jax.tree_util.tree_unflatten(treedef, out)


# A stored leaf of one of these dtypes loads into params of another (cast, as orbax does).
_FLOATS = {np.dtype(t) for t in (jax.numpy.bfloat16, np.float16, np.float32, np.float64)}


def _stored_dtype(name: Any, want: np.dtype, leaf: str, path: str) -> np.dtype:
    """The dtype a leaf was stored in: the params' own, or another floating dtype (never one
    read from the file otherwise: the bytes are viewed as it)."""
    if name == str(want):
        return want
    stored = next((t for t in _FLOATS if str(t) == name), None)
    if stored is None or want not in _FLOATS:
        raise ValueError(f"{path}: leaf {leaf} is stored as {name!r}, the params are {want}")
    return stored


def _leaf_name(key: tuple) -> str:
    """A leaf's tree path as "a/b/0": dict keys and sequence indices alike, so a tree keyed by
    the strings "0", "1" matches one keyed by the ints (as orbax's names do)."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key)


def _placed(array: np.ndarray, like: Any) -> jax.Array:
    """`array` on `like`'s sharding and dtype, each addressable shard copied out of the mapped
    file (nothing of it is kept)."""
    dtype = np.dtype(like.dtype)
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jax.numpy.asarray(np.array(array, dtype))
    return jax.make_array_from_callback(array.shape, sharding, lambda i: np.array(array[i], dtype))


def tree_bytes(params: Any) -> int:
    """Bytes of the arrays of `params` (whole arrays, whatever their sharding or memory kind;
    `jax.ShapeDtypeStruct`s count too, leaves without a shape and dtype count 0)."""
    return sum(
        math.prod(x.shape) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(params)
        if hasattr(x, "shape") and hasattr(x, "dtype")
    )


def load_params(path: str | os.PathLike[str], like: Any, *, verify: bool = False) -> Any:
    """Restores the params `save_weights` (or `save_params`, `save_flat`) wrote at `path`, shaped
    and sharded like `like`: flat weights when `path` holds `FLAT_INDEX` (`load_flat`), orbax's
    otherwise.

    Args:
      path: a local directory (made absolute) or a URL.
      like: a pytree of jax arrays or `jax.ShapeDtypeStruct`s giving each leaf's shape, dtype and
        sharding.
      verify: flat weights: check their CRC-32 first (`load_flat`); orbax checks its own.

    Returns:
      The params, a pytree of the structure of `like`.

    Raises:
      Exception: whatever orbax raises for a missing directory, a directory that is not a
        checkpoint, or params of another structure (its types vary: FileNotFoundError,
        ValueError, KeyError, ...); `load_flat`'s ValueError.
    """
    if is_flat(path):
        return load_flat(path, like, verify=verify)
    if is_sharded(path):
        return load_sharded(path, like, verify=verify)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    with ORBAX_LOCK, ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(absolute(path), abstract)


class _LeakFreeSpec:
    """A `ts.KvStore.Spec` whose `to_json()` (no arguments) is read from its repr."""

    def __init__(self, spec: ts.KvStore.Spec):
        self.spec = spec

    def to_json(self, *args: Any, **kwargs: Any) -> Any:
        text = repr(self.spec)
        prefix = "KvStore.Spec("
        if not (args or kwargs) and text.startswith(prefix) and text.endswith(")"):
            try:
                return ast.literal_eval(text[len(prefix) : -1])
            except (ValueError, SyntaxError):
                pass
        return self.spec.to_json(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.spec, name)


class _LeakFreeKvStore:
    """`ts.KvStore` for orbax's `tensorstore_utils`: `Spec(...)` wraps the spec in `_LeakFreeSpec`,
    `open` unwraps it; everything else is tensorstore's."""

    @staticmethod
    def Spec(*args: Any, **kwargs: Any) -> _LeakFreeSpec:
        return _LeakFreeSpec(ts.KvStore.Spec(*args, **kwargs))

    @staticmethod
    def open(spec: Any, *args: Any, **kwargs: Any) -> Any:
        return ts.KvStore.open(getattr(spec, "spec", spec), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(ts.KvStore, name)


class _LeakFreeTensorstore:
    """The `tensorstore` module as orbax's `tensorstore_utils` sees it, with `_LeakFreeKvStore`."""

    KvStore = _LeakFreeKvStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(ts, name)


def leak_free_kvstore_specs() -> None:
    """Makes orbax (0.12.8) resolve kvstore specs without tensorstore's leaking `to_json`.

    tensorstore's (0.1.86) `KvStore.Spec.to_json()` keeps one reference to every string of the
    dict it returns, and orbax calls it once per array on every save and restore
    (`tensorstore_utils._build_ocdbt_kvstore_tspec`). The spec's repr is the same dict as a Python
    literal and leaks nothing, so orbax's `tensorstore_utils` gets a `tensorstore` whose
    `KvStore.Spec(...).to_json()` parses the repr. Idempotent.
    """
    if not isinstance(tensorstore_utils.ts, _LeakFreeTensorstore):
        tensorstore_utils.ts = _LeakFreeTensorstore()


leak_free_kvstore_specs()


def absolute(path: str | os.PathLike[str]) -> str:
    """`path` made absolute when local; a URL (anything with "://") unchanged."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)
