"""TPU slices without TPUs: compile-only devices from libtpu, the chips' figures, and HBM accounting.

JAX compiles for a TPU topology on any machine where libtpu is installed:
``jax.experimental.topologies.get_topology_desc`` asks libtpu for the devices of, say, a v5p
4x4x4 slice, and ``jax.jit(f).lower(ShapeDtypeStructs with NamedShardings on a Mesh of them)
.compile()`` runs the real XLA:TPU compiler, so its memory analysis and cost analysis are the
target's (MaxText's train_compile.py works the same way). Nothing runs and no TPU is touched.

libtpu outside a TPU VM (``offline_libtpu_env``, which ``python -m sat_jax.plan`` sets before libtpu
first loads):

* ``TPU_SKIP_MDS_QUERY=1``: libtpu does not ask the GCE metadata server
  (metadata.google.internal) for the host's accelerator type and worker list. JAX also sets it
  when no TPU is on the PCI bus; we set it ourselves so the compile never depends on that probe.
* ``TPU_WORKER_HOSTNAMES=localhost`` and ``TPU_ACCELERATOR_TYPE``: what libtpu would otherwise
  look up on the network; with them it prints no "could not determine" warnings. They describe
  this (compile-only) host; the target comes from ``get_topology_desc``'s arguments alone.
* ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``: without it libtpu takes ``/tmp/libtpu_lockfile`` for the
  process's lifetime and a second process that loads libtpu fails with ABORTED. Any JAX process
  that probes for a TPU backend holds that lock (a CPU run without ``JAX_PLATFORMS``), so a
  compile beside one, or two pytest workers, would fail.

Each is set only when not already set (``os.environ.setdefault``), so a TPU VM's own values win.
Checked on a machine without TPUs (``strace -f -e trace=network``): topology creation and
compilation open no AF_INET socket.

Chip figures (``CHIPS``, keyed by ``Device.device_kind``): HBM capacity and bandwidth and peak bf16
FLOP/s per chip from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v4, v5e,
v5p, v6e). Compile-only devices have no ``memory_stats()``, so JAX cannot report the HBM; the
XLA:TPU compiler knows its own limit (it refuses a program that exceeds it, naming the available
bytes: 95.74 GiB on a v5p with libtpu 0.0.42.1), and that refusal is reported as "does not fit"
(``parse_out_of_memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Iterator, Sequence
from unittest import mock

import jax

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One TPU chip's figures (one JAX device per chip on these kinds).

    Attributes:
      name: the Cloud TPU name ("v5p", "v5e", ...).
      hbm_gib: HBM capacity per chip, GiB.
      hbm_gbps: HBM bandwidth per chip, 10^9 bytes/s.
      bf16_tflops: peak bf16 matmul throughput per chip, 10^12 FLOP/s.
    """

    name: str
    hbm_gib: float
    hbm_gbps: float
    bf16_tflops: float

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gib * GIB)


# Device.device_kind -> figures (module docstring for the sources). The pages give HBM as "95GB",
# "16 GB", "32 GB", "32 GiB"; the parts are binary-sized (XLA:TPU's own v5p limit is 95.74 GiB),
# so the numbers are taken as GiB.
CHIPS: dict[str, Chip] = {
    "TPU v4": Chip(name="v4", hbm_gib=32, hbm_gbps=1200, bf16_tflops=275),
    "TPU v5": Chip(name="v5p", hbm_gib=95, hbm_gbps=2765, bf16_tflops=459),
    "TPU v5 lite": Chip(name="v5e", hbm_gib=16, hbm_gbps=819, bf16_tflops=197),
    "TPU v6 lite": Chip(name="v6e", hbm_gib=32, hbm_gbps=1638, bf16_tflops=918),
}
# Topology-name prefixes libtpu accepts, and the chip config giving one device per chip.
_MEGACORE = ("v4", "v5p", "v5")
_NAME_RE = re.compile(r"^(v4|v5p|v5|v5e|v6e):(\d+(?:x\d+){1,2})$")


class LibtpuMissing(RuntimeError):
    """libtpu is not installed, so no TPU topology can be compiled for (``pip install .[tpu]``)."""


class LibtpuUnavailable(RuntimeError):
    """libtpu is installed but did not load or did not give the topology."""


def offline_libtpu_env(name: str) -> dict[str, str]:
    """The environment that keeps libtpu off the network and off its lockfile for a compile for
    topology ``name`` (module docstring). The command sets each value where it is unset
    (``os.environ.setdefault``: a TPU VM's own values win) before libtpu first loads; the library
    reads no environment variables.

    Raises:
      ValueError: a malformed name (``parse_topology``).
    """
    kind, dims = parse_topology(name)
    chips = math.prod(dims)
    # Cloud TPU names count TensorCores on v4 and v5p (two per chip), chips on v5e and v6e.
    accelerator = {"v4": f"v4-{2 * chips}", "v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}"}
    return {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_ACCELERATOR_TYPE": accelerator.get(kind, f"v5p-{2 * chips}"),
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def libtpu_installed(library_path: str = "") -> bool:
    """Whether JAX can find libtpu: the ``libtpu`` package, or ``library_path`` (the value of
    ``TPU_LIBRARY_PATH``, which the command reads) naming a file."""
    path = library_path
    return bool(path and os.path.isfile(path)) or importlib.util.find_spec("libtpu") is not None


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """``"v5p:4x4x4"`` -> ``("v5p", (4, 4, 4))``.

    Raises:
      ValueError: not KIND:AxB[xC] with KIND one of v4, v5p, v5e, v6e.
    """
    match = _NAME_RE.match(name.strip())
    if match is None:
        raise ValueError(
            f"topology {name!r} is not KIND:AxB[xC] with KIND in v4, v5p, v5e, v6e "
            "(e.g. v5p:4x4x4, v5e:4x4, v6e:4x8)"
        )
    dims = tuple(int(d) for d in match.group(2).split("x"))
    if min(dims) < 1:
        raise ValueError(f"topology {name!r} has a zero dimension")
    return match.group(1), dims


def topology_devices(name: str) -> list[jax.Device]:
    """The compile-only devices of TPU topology ``name`` (one per chip), from libtpu.

    Call it with libtpu's environment set (``offline_libtpu_env``; ``python -m sat_jax.plan``
    sets it).

    A full cube of a 3D torus (every dimension a multiple of 4) and the 16-chip sides of a 2D one
    wrap around, as on the real slices; hosts hold 2x2 chips.

    Raises:
      ValueError: a malformed name (``parse_topology``).
      LibtpuUnavailable: libtpu did not load or refused the topology.
    """
    kind, dims = parse_topology(name)
    chips = math.prod(dims)
    from jax.experimental import topologies

    if len(dims) == 3:
        wrap = (all(d % 4 == 0 for d in dims),) * 3
    else:
        wrap = (*(d == 16 for d in dims), False)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=name.strip(),
            chip_config_name="megacore" if kind in _MEGACORE else "default",
            chips_per_host_bounds=(*(min(2, d) for d in dims[:2]), 1),
            num_slices=1,
            wrap=wrap,
        )
    except Exception as e:  # libtpu raises JaxRuntimeError / RuntimeError with its own text
        raise LibtpuUnavailable(f"libtpu is installed but gave no topology {name!r}: {e}") from e
    if len(desc.devices) != chips:
        raise LibtpuUnavailable(
            f"topology {name!r}: libtpu gave {len(desc.devices)} devices, expected {chips} "
            "(one per chip)"
        )
    return list(desc.devices)


def chip_of(devices: Sequence[jax.Device], hbm_gib: float | None = None) -> Chip:
    """The figures of ``devices``' chip kind; ``hbm_gib`` overrides its HBM capacity.

    Raises:
      ValueError: an unknown chip kind without an ``hbm_gib`` override.
    """
    kind = devices[0].device_kind
    chip = CHIPS.get(kind)
    if chip is None:
        if hbm_gib is None:
            raise ValueError(
                f"no HBM figure for device kind {kind!r} (known: {sorted(CHIPS)}); give --hbm-gib"
            )
        chip = Chip(name=kind, hbm_gib=hbm_gib, hbm_gbps=math.nan, bf16_tflops=math.nan)
    return chip if hbm_gib is None else dataclasses.replace(chip, hbm_gib=hbm_gib)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramMemory:
    """Per-device bytes of one compiled program (XLA's ``CompiledMemoryStats``).

    Attributes:
      argument: the inputs, all resident while the program runs.
      output: the outputs, including those aliasing a donated input.
      alias: the outputs written into donated input buffers (counted in both of the above).
      temp: the program's scratch (activations, gradients before the update, collectives).
      code: the program's generated code, loaded into HBM on a TPU.
    """

    argument: int
    output: int
    alias: int
    temp: int
    code: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> ProgramMemory:
        stats = compiled.memory_analysis()
        return cls(
            argument=stats.argument_size_in_bytes,
            output=stats.output_size_in_bytes,
            alias=stats.alias_size_in_bytes,
            temp=stats.temp_size_in_bytes,
            code=stats.generated_code_size_in_bytes,
        )

    @property
    def total(self) -> int:
        """argument + output − alias + temp + code: the peak of one call. A donated input's
        buffer is reused by its output, so it is counted once."""
        return self.argument + self.output - self.alias + self.temp + self.code


_OOM_PATTERNS = (
    # "the total memory required for HLO temporaries (150.00G) exceeds available HBM (95.74G)"
    re.compile(r"\(([\d.]+)([KMGT])\)\s+exceeds available HBM\s+\(([\d.]+)([KMGT])\)"),
    # "Ran out of memory in memory space hbm. Used 104.35G of 95.74G hbm."
    re.compile(r"Used\s+([\d.]+)([KMGT])\s+of\s+([\d.]+)([KMGT])\s+hbm", re.IGNORECASE),
)
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_out_of_memory(message: str) -> tuple[int, int] | None:
    """(required, available) bytes from an XLA:TPU RESOURCE_EXHAUSTED compile error, or None
    when ``message`` is not one (or names no numbers)."""
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    for pattern in _OOM_PATTERNS:
        match = pattern.search(message)
        if match:
            need, unit, have, unit2 = match.groups()
            return int(float(need) * _UNIT[unit]), int(float(have) * _UNIT[unit2])
    return None


@contextlib.contextmanager
def traced_for(platform: str, device_count: int) -> Iterator[None]:
    """While tracing inside, ``jax.default_backend()`` answers ``platform`` and
    ``jax.device_count()`` the target's ``device_count``.

    The model picks its "auto" attention and dispatch paths from them at trace time
    (`sat_jax.model.tpu_kernels`: a TPU kernel where it can be placed, i.e. under an ambient mesh
    or on one device); compiling here for a TPU, they would be this host's CPU and its device
    count, and the program would hold the CPU paths, or a kernel that a multi-chip server traced
    without a mesh never uses. Only the model's choices read them this way (JAX's own code asks
    ``xla_bridge``), so the lowered program is the one the target's trainer or server traces.
    """
    with (
        mock.patch.object(jax, "default_backend", lambda: platform),
        mock.patch.object(jax, "device_count", lambda backend=None: device_count),
    ):
        yield
