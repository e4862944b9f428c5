"""Device catalog: datasheet figures per device kind (data in ``data/devices.json``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from autoconf.errors import UserError


@dataclass(frozen=True)
class CollectiveTuning:
    """What a collective library adds to the links: a fixed cost per call and the fraction of each
    tier's bandwidth it reaches. Neutral (0 s, 1.0, 1.0) is the bare alpha-beta model."""

    base_latency_s: float = 0.0
    """Fixed cost of one collective call (launch, set-up, handshake), on top of per-step latency."""
    intra_efficiency: float = 1.0
    """Bus bandwidth reached over the intra-node fabric, as a fraction of its link bandwidth."""
    inter_efficiency: float = 1.0
    """Bus bandwidth reached across hosts (NICs), as a fraction of their bandwidth."""
    short_ring_loss: float = 0.0
    """How much of ``intra_efficiency`` a short ring inside a host gives up: a ring of k members
    there reaches ``intra_efficiency - short_ring_loss / k`` of the fabric. On an NVSwitch node a
    2-GPU ring's large all-reduce reaches 0.67 of NVLink's rate and an 8-GPU ring 0.76 (nccl-tests,
    8 x A100): fewer peers leave more of the switch's ports idle."""

    def intra(self, local_members: int) -> float:
        """Fraction of the intra-node fabric a collective with ``local_members`` per host reaches."""
        return self.intra_efficiency - self.short_ring_loss / max(local_members, 1)


NEUTRAL = CollectiveTuning()


@dataclass(frozen=True)
class DeviceType:
    name: str
    peak_flop_per_s: dict
    """Dense peak per dtype: bf16, fp16, fp32; fp8 where the device has FP8 tensor cores (Hopper,
    Ada, Blackwell), mxfp8 and fp4 where it has microscaling ones (Blackwell)."""
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    gemm_efficiency: float
    """Fraction of peak a large GEMM reaches; a profile replaces it with a measurement."""
    memory_efficiency: float
    """Fraction of memory bandwidth a streaming kernel reaches."""
    kernel_launch_s: float
    """Fixed cost per kernel launch."""
    framework_overhead_bytes: float = 0.0
    """Device memory held outside the allocator's count (CUDA context, workspaces, comm buffers)."""
    sm_count: int = 0
    """Streaming multiprocessors (GPU): GEMM tiles are scheduled over them in waves. 0: no wave
    quantization (CPU)."""
    collective: dict = None
    """What the collective library reaches on this device's links: ``base_latency_s`` per call,
    ``intra_efficiency`` and ``inter_efficiency`` of the intra-node fabric's and the NICs'
    bandwidth, ``short_ring_loss`` of short rings inside a host (see ``specs.devices.CollectiveTuning``). None: the bare alpha-beta model."""

    attention_efficiency: dict = None
    """Fraction of peak the fused (flash) attention kernel the frameworks run by default reaches,
    ``forward`` and ``backward``, causal, at head dim 128 over long sequences (FlashAttention-2 on
    A100, cuDNN's on Hopper; ``cost.attention.attention_shape_efficiency`` scales it to the shape).
    None: the GEMM efficiency."""

    attention_kernels: dict = None
    """The same fractions (``forward``, ``backward``) of other fused attention kernels a framework
    may run instead (``Framework.attention_kernel``), by name: ``flash2`` (FlashAttention-2, what
    torch's SDPA ran on Hopper before it preferred cuDNN's). None, or a kernel not listed: the
    device's default kernel, ``attention_efficiency``."""

    def attention_efficiency_of(self, kernel: str = "") -> dict | None:
        """``attention_efficiency``, or that of ``kernel`` where the device lists it."""
        return (self.attention_kernels or {}).get(kernel) or self.attention_efficiency

    special_function_per_s: float = 0.0
    """Exponentials per second of the special-function units (GPUs): the softmax's share of fused
    attention, which makes a small head dimension slower per FLOP. 0: not modelled."""

    unaligned_gemm_factor: float = 0.17
    """A GEMM with a dimension that is not a multiple of 16 bytes (``cost.roofline.aligned_gemm``)
    runs at this fraction of the aligned rate. Measured on an H100 SXM (torch 2.11, cuBLAS of CUDA
    13.0): a 50257-wide vocabulary projection reached 0.12-0.14 of the rate padded to a multiple
    of 8 in the forward and 0.17-0.22 in the two backward GEMMs (bench/gpu_host_device.py). Other
    GPUs take the same figure until measured: their cuBLAS kernels need the same 16-byte vectors."""

    dtype_gemm_efficiency: dict = None
    """Fraction of a dtype's peak a large GEMM reaches where it differs from ``gemm_efficiency``
    (FP8 GEMMs reach less of their doubled peak). None: ``gemm_efficiency`` for every dtype."""

    tdp_w: float = 0.0
    """Board power the datasheet's peaks are stated at (its TDP). 0: not stated (no power cap)."""
    idle_w: float = 0.0
    """Power the board draws clocked up but idle (leakage, HBM refresh): the part a power cap
    cannot scale down (:func:`capped_clock_ratio`)."""
    boost_clock_hz: float = 0.0
    """The clock the datasheet's peaks are stated at (the peaks scale with it). 0: not stated."""
    deployed: dict = None
    """How this device differs from the catalog's as deployed (``power_cap_w``, ``clock_hz``,
    ``memory_bandwidth_bytes_per_s``; :func:`deployed_name`). None: as the catalog states it."""

    def gemm_efficiency_of(self, dtype: str) -> float:
        """The large-GEMM efficiency of ``dtype`` (FP8 and MXFP8 may differ from 16-bit)."""
        eff = (self.dtype_gemm_efficiency or {}).get(dtype)
        if eff is None and dtype == "mxfp8":
            eff = (self.dtype_gemm_efficiency or {}).get("fp8")
        return self.gemm_efficiency if eff is None else eff

    def collective_tuning(self):
        return CollectiveTuning(**self.collective) if self.collective else NEUTRAL

    def supports(self, dtype: str) -> bool:
        """Whether :meth:`peak` serves ``dtype`` (bf16 on a device without bf16 units, V100, counts:
        PyTorch runs it there at fp32 speed)."""
        return dtype in self.peak_flop_per_s or (dtype == "bf16" and "fp16" in self.peak_flop_per_s)

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s of ``dtype``; a UserError naming the valid ones where the device has none."""
        if dtype in self.peak_flop_per_s:
            return self.peak_flop_per_s[dtype]
        if dtype == "bf16" and "fp16" in self.peak_flop_per_s:
            # no bf16 units (V100): PyTorch runs bf16 at fp32 speed there
            return self.peak_flop_per_s["fp32"]
        raise UserError(f"device {self.name} has no {dtype} figure; valid: {', '.join(self.peak_flop_per_s)}")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@lru_cache(maxsize=1)
def _catalog() -> dict:
    text = resources.files("autoconf").joinpath("data/devices.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


@lru_cache(maxsize=1)
def _accuracy_text() -> str | None:
    try:
        return resources.files("autoconf").joinpath("data/accuracy.json").read_text()
    except OSError:
        return None


def stated_accuracy() -> dict | None:
    """The cost model's stated step-time accuracy: ``step_time`` of ``autoconf/data/accuracy.json``
    (median and max relative error, what it was measured on, the bench that measured it; written
    by ``bench/gpu_devset.py --write-accuracy``), a fresh dict; None where the file is missing."""
    text = _accuracy_text()
    return None if text is None else json.loads(text).get("step_time")


def device_names() -> list[str]:
    return list(_catalog())


@lru_cache(maxsize=None)
def device_type(name: str) -> DeviceType:
    """The catalog's device ``name``, or a device as deployed (``base@power=500W,...``:
    :func:`deployed_name`). Built once per name (the cost model asks per stage and per estimate);
    the DeviceType is frozen."""
    base, _, spec = name.partition("@")
    cat = _catalog()
    if base not in cat:
        raise UserError(f"unknown device {base!r}; valid: {', '.join(cat)}")
    dev = DeviceType(name=base, **cat[base])
    return _deploy(dev, _parse_deployed(name, spec)) if spec else dev


# -- devices as deployed -------------------------------------------------------------------------------

DEPLOYED_KEYS = (("power", "power_cap_w", "W"), ("clock", "clock_hz", "Hz"), ("hbm", "memory_bandwidth_bytes_per_s", "B/s"))
"""(short key in a deployed device's name, the field it sets, its unit), in name order."""


def deployed_name(base: str, power_cap_w: float | None = None, clock_hz: float | None = None,
                  memory_bandwidth_bytes_per_s: float | None = None) -> str:
    """The name of catalog device ``base`` as deployed: power-capped, clocked, or with other HBM
    bandwidth (a cluster file's node group states them; capacity is the group's ``memory``).
    ``h100-sxm@power=500W,hbm=2.4e+12B/s``; the base name alone where nothing differs. A
    ``base`` already deployed keeps what the arguments do not restate."""
    given = {"power_cap_w": power_cap_w, "clock_hz": clock_hz,
             "memory_bandwidth_bytes_per_s": memory_bandwidth_bytes_per_s}
    base, _, spec = base.partition("@")
    how = {**(_parse_deployed(f"{base}@{spec}", spec) if spec else {}),
           **{k: v for k, v in given.items() if v is not None}}
    parts = [f"{key}={how[field]:g}{unit}" for key, field, unit in DEPLOYED_KEYS if field in how]
    return f"{base}@{','.join(parts)}" if parts else base


def _parse_deployed(name: str, spec: str) -> dict:
    out = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        field, unit = next(((f, u) for k, f, u in DEPLOYED_KEYS if k == key), (None, None))
        if unit is None or not value.endswith(unit):
            raise UserError(f"device {name!r}: cannot read {part!r}; valid: power=<W>W, clock=<Hz>Hz, hbm=<B/s>B/s")
        try:
            v = float(value[: -len(unit)])
        except ValueError:
            raise UserError(f"device {name!r}: {part!r} is not a number with its unit") from None
        if not (v > 0 and v < float("inf")):
            raise UserError(f"device {name!r}: {part!r} must be positive and finite")
        out[field] = v
    return out


def capped_clock_ratio(dev: DeviceType, power_cap_w: float) -> float:
    """The clock a dense tensor-core kernel sustains under a board power cap, as a fraction of the
    clock the peaks are stated at.

    CMOS dynamic power is a*C*V^2*f and, over a GPU's DVFS range, the voltage rises about in
    proportion to the clock, so the dynamic part goes as f^3; the idle part (leakage, HBM refresh)
    does not scale. A device whose datasheet peak holds at its TDP then sustains
    ``((cap - idle) / (tdp - idle)) ** (1/3)`` of that clock under ``cap`` (1.0 at or above TDP).
    E.g. an H100 SXM (700 W, 70 W idle) capped at 500 W: 0.88 of its GEMM rate."""
    if not dev.tdp_w:
        raise UserError(f"device {dev.name} has no stated TDP, so a power cap cannot be applied; "
                        f"state its clock instead")
    if power_cap_w <= dev.idle_w:
        raise UserError(f"power cap {power_cap_w:g} W is at or below device {dev.name}'s idle draw "
                        f"({dev.idle_w:g} W); valid: above it, up to its TDP {dev.tdp_w:g} W")
    if power_cap_w >= dev.tdp_w:
        return 1.0
    return ((power_cap_w - dev.idle_w) / (dev.tdp_w - dev.idle_w)) ** (1.0 / 3.0)


def _deploy(dev: DeviceType, how: dict) -> DeviceType:
    """``dev`` as deployed: its compute peaks scaled by the sustained clock (the lower of a stated
    clock and what the power cap sustains), its HBM bandwidth replaced where stated."""
    ratio = 1.0
    if "clock_hz" in how:
        if not dev.boost_clock_hz:
            raise UserError(f"device {dev.name} has no stated boost clock, so its clock cannot be set; "
                            f"state a power cap, or measure it with `autoconf profile`")
        ratio = how["clock_hz"] / dev.boost_clock_hz
    if "power_cap_w" in how:
        ratio = min(ratio, capped_clock_ratio(dev, how["power_cap_w"]))
    changes = {"peak_flop_per_s": {k: v * ratio for k, v in dev.peak_flop_per_s.items()},
               "deployed": dict(how),
               "name": deployed_name(dev.name, **how)}
    if dev.special_function_per_s:
        changes["special_function_per_s"] = dev.special_function_per_s * ratio
    if "memory_bandwidth_bytes_per_s" in how:
        changes["memory_bandwidth_bytes_per_s"] = how["memory_bandwidth_bytes_per_s"]
    return dataclasses.replace(dev, **changes)


def base_device(name: str) -> str:
    """The catalog name of a device, deployed or not."""
    return name.partition("@")[0]




