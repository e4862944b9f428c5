"""Profile: what ``autoconf profile`` measured on the real devices, as a versioned JSON file.

A profile holds, for one ModelSpec on one set of ranks:

- provenance: hosts (with their network interfaces), device names, torch version, backend, date,
  the command line;
- the ranks seen: rank, host, local rank, device name and its catalog kind ('cpu' on CPU);
- compute: forward and backward seconds of one layer shard (embedding / block / head) per
  micro-batch size, tensor-parallel degree and recompute mode, medians of repeats with spreads;
  backward includes the recomputed forward when recompute is not 'none';
- GEMM efficiency: achieved FLOP/s of (m, n, k, dtype) matmuls and their fraction of catalog peak;
  dtype is the model's, or ``fp8_tensorwise`` / ``fp8_rowwise`` for FP8 GEMMs (of the fp8 peak);
- memory: saved-activation bytes per layer kind, micro-batch size, tp, sequence parallelism and
  recompute; parameter bytes per layer kind and tp; the framework overhead of one rank;
- links: alpha (latency_s) and beta (bandwidth_bytes_per_s) per ordered pair of ranks, fit to the
  medians of point-to-point transfers of several sizes;
- collectives: all_reduce / all_gather / reduce_scatter times for groups of ranks.

Everything is SI (seconds, bytes, bytes/s, FLOP/s). This module is pure Python: no torch.
The file is written atomically (:func:`save_profile`) and checked on load (:func:`load_profile`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from autoconf.errors import UserError
from autoconf.files import write_text
from autoconf.specs.devices import base_device
from autoconf.specs.devices import device_names as _catalog_names
from autoconf.specs.model import DTYPES, MODEL_SCHEMA, ModelSpec
from autoconf.specs.schema import (
    Bool,
    Dict,
    Int,
    List,
    Map,
    Null,
    Num,
    Str,
    check_kind,
    parse_json,
    read_text,
    show_value,
)

PROFILE_VERSION = 1
LAYER_KINDS = ("embedding", "block", "head")
RECOMPUTE_MODES = ("none", "selective", "full")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
GEMM_FP8_DTYPES = ("fp8_tensorwise", "fp8_rowwise")
"""GEMM-table dtypes beyond the model's: FP8 ``torch._scaled_mm`` with that recipe's scaling
(``fp8_gemm_efficiency``); valid for ``gemm`` entries only, not as ``compute_dtype``."""

# Shape fields a layer kind's compute time depends on. Fields outside these (name, num_layers,
# tied_embeddings, ...) may differ between the profiled model and the one being planned.
_BLOCK_FIELDS = ("hidden_size", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "seq_length",
                 "activation", "dtype", "norm", "bias", "attention", "dropout", "position_embedding",
                 "head_dim", "qkv_bias", "parallel_attention", "shared_norm", "rotary_fraction")
_EMBEDDING_FIELDS = ("hidden_size", "vocab_size", "seq_length", "dtype", "position_embedding", "dropout")
_HEAD_FIELDS = ("hidden_size", "vocab_size", "seq_length", "dtype", "norm")
COMPUTE_FIELDS = {"block": _BLOCK_FIELDS, "embedding": _EMBEDDING_FIELDS, "head": _HEAD_FIELDS}


@dataclass(frozen=True)
class HostInfo:
    name: str
    """Host name as the rank saw it (socket.gethostname())."""
    interfaces: tuple = ()
    """Network interfaces: ({"name": "eth0", "speed_bytes_per_s": 3.125e9 or None}, ...), from
    /sys/class/net (speed unknown for virtual links)."""
    cpu_count: int = 0
    memory_bytes: float = 0.0
    """Host RAM (MemTotal)."""
    machine: str = ""
    """The kernel's boot id: hosts with the same one are one machine whose cores their ranks share
    (the emulated nodes of ``autoconf testbed``, containers); '' when unknown."""


@dataclass(frozen=True)
class Provenance:
    hosts: tuple
    """HostInfo per host, in order of the first rank on each."""
    device_names: tuple
    """Distinct device names seen (e.g. 'NVIDIA H100 80GB HBM3', 'cpu')."""
    torch_version: str
    backend: str
    """'nccl' or 'gloo'."""
    date: str
    """ISO 8601, UTC."""
    command: str
    """The command line that produced the profile."""
    world_size: int
    autoconf_version: str = ""
    notes: tuple = ()
    """Free-form remarks on how things were measured (e.g. the compute split on CPU)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    local_rank: int
    device_name: str
    device_kind: str | None
    """Catalog name ('cpu', 'h100-sxm', ...), None if the device is not in the catalog."""
    memory_bytes: float
    """Device memory (CUDA: total memory; CPU: host RAM divided by the ranks on the host)."""


@dataclass(frozen=True)
class LayerTiming:
    layer: str
    """'embedding', 'block' or 'head'."""
    micro_batch_size: int
    tp: int
    """Tensor-parallel degree of the shard measured (local width = full width / tp)."""
    recompute: str
    """'none', 'selective' or 'full' (always 'none' for embedding and head)."""
    forward_s: float
    backward_s: float
    """Backward of the shard, including the recomputed forward when recompute is not 'none'."""
    forward_spread_s: float
    """Interquartile range of the forward repeats (their range with fewer than 4 repeats)."""
    backward_spread_s: float
    repeats: int
    device_kind: str | None
    rank: int
    """The rank that measured it."""


@dataclass(frozen=True)
class GemmEntry:
    m: int
    n: int
    k: int
    dtype: str
    time_s: float
    flop_per_s: float
    fraction_of_peak: float | None
    """flop_per_s / catalog peak for the dtype (the fp8 peak for ``fp8_*`` rows); None for devices
    outside the catalog."""
    device_kind: str | None


@dataclass(frozen=True)
class MemoryEntry:
    """One element-wise kernel timed on the device (``torch.add`` into a third tensor):
    ``bytes`` moved per call (three operands) and the median seconds per call, launch included."""
    bytes: float
    time_s: float
    dtype: str
    device_kind: str | None


@dataclass(frozen=True)
class ActivationEntry:
    layer: str
    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    recompute: str
    bytes: float
    """Bytes saved for backward by one layer shard for one micro-batch."""


@dataclass(frozen=True)
class ParameterEntry:
    layer: str
    tp: int
    bytes: float
    """Parameter bytes of one layer shard at the model's dtype."""
    count: int


@dataclass(frozen=True)
class MemoryOverhead:
    framework_overhead_bytes: float
    """Memory a rank costs before any model tensor exists (see method)."""
    method: str
    """How it was measured, in words."""
    step_peak_bytes: dict = field(default_factory=dict)
    """CUDA only: 'layer/mbs/tp/recompute' -> torch.cuda.max_memory_allocated of one forward+backward."""


@dataclass(frozen=True)
class LinkEntry:
    src: int
    dst: int
    latency_s: float
    """Alpha: one-way latency (half the intercept of a message-and-ack round trip)."""
    bandwidth_bytes_per_s: float
    """Beta: 1 / slope of transfer time versus message size."""
    sizes_bytes: tuple
    times_s: tuple
    """Median round-trip time (message src->dst, 4-byte ack back) per size."""


@dataclass(frozen=True)
class CollectiveEntry:
    op: str
    ranks: tuple
    bytes: float
    """Size of the full buffer: the all_reduce input, the all_gather output, the reduce_scatter input."""
    time_s: float
    """Median over repeats."""
    algbw_bytes_per_s: float
    """bytes / time_s."""
    busbw_bytes_per_s: float
    """algbw x 2(n-1)/n for all_reduce, x (n-1)/n otherwise (nccl-tests' convention)."""


@dataclass(frozen=True)
class TpBlockTiming:
    """One block run with its REAL tensor-parallel collectives (ranks 0..tp-1 of a host).

    Its time minus the local-width time of the same shard (``LayerTiming`` at the same tp and
    micro-batch size) is the tensor-parallel communication as training experiences it: the
    collectives plus the waits and wake-ups around them, which a tight loop of collectives
    does not show (on CPU/gloo a 128 KiB all-reduce costs ~0.5 ms in a loop, ~2 ms between GEMMs).
    """

    micro_batch_size: int
    tp: int
    sequence_parallel: bool
    forward_s: float
    backward_s: float
    repeats: int
    device_kind: str | None = None


@dataclass(frozen=True)
class OptimizerTiming:
    """One AdamW step over the parameters of one block shard (torch.optim.AdamW, as the trainer)."""

    tp: int
    num_params: int
    time_s: float
    repeats: int
    device_kind: str | None = None


@dataclass(frozen=True)
class PipelineOverheadTiming:
    """The pipeline runtime's own cost: one step of ``schedule`` (torch.distributed.pipelining, as
    the trainer) over ranks 0..pp-1 with trivial stages (one 16x16 linear per chunk, 16-float
    activations), so the time is the schedule's bookkeeping and its point-to-point round trips.
    ``per_action_s`` = step / (2 x micro-batches x chunks per rank)."""

    schedule: str
    pp: int
    virtual_stages: int
    num_micro_batches: int
    step_s: float
    per_action_s: float
    repeats: int


@dataclass(frozen=True)
class Profile:
    version: int
    provenance: Provenance
    model: ModelSpec
    ranks: tuple
    compute_dtype: str
    """dtype the layers and GEMMs ran in."""
    compute: tuple = ()
    gemm: tuple = ()
    activations: tuple = ()
    parameters: tuple = ()
    overhead: MemoryOverhead | None = None
    links: tuple = ()
    collectives: tuple = ()
    tp_blocks: tuple = ()
    """TpBlockTiming entries (absent in profiles written before they were measured)."""
    optimizer: tuple = ()
    """OptimizerTiming entries (absent in older profiles)."""
    pipeline_overhead: tuple = ()
    """PipelineOverheadTiming entries, one per schedule (absent in older profiles)."""
    memory: tuple = ()
    """MemoryEntry entries: the memory-bound kernel's time over sizes (absent in older profiles)."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank(self, r: int) -> RankInfo:
        for x in self.ranks:
            if x.rank == r:
                return x
        raise KeyError(r)

    def link(self, src: int, dst: int) -> LinkEntry | None:
        for x in self.links:
            if x.src == src and x.dst == dst:
                return x
        return None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        if not d["memory"]:  # profiles from before the memory curve keep their digest (study names)
            del d["memory"]
        return _jsonable(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        prov = dict(d["provenance"])
        prov["hosts"] = tuple(HostInfo(**{**h, "interfaces": tuple(h.get("interfaces", ()))}) for h in prov["hosts"])
        for k in ("device_names", "notes"):
            prov[k] = tuple(prov.get(k, ()))
        ov = d.get("overhead")
        return cls(
            version=d["version"],
            provenance=Provenance(**prov),
            model=ModelSpec.from_dict(d["model"]),
            ranks=tuple(RankInfo(**r) for r in d["ranks"]),
            compute_dtype=d["compute_dtype"],
            compute=tuple(LayerTiming(**x) for x in d.get("compute", ())),
            gemm=tuple(GemmEntry(**x) for x in d.get("gemm", ())),
            memory=tuple(MemoryEntry(**x) for x in d.get("memory", ())),
            activations=tuple(ActivationEntry(**x) for x in d.get("activations", ())),
            parameters=tuple(ParameterEntry(**x) for x in d.get("parameters", ())),
            overhead=MemoryOverhead(**ov) if ov else None,
            links=tuple(LinkEntry(**{**x, "sizes_bytes": tuple(x["sizes_bytes"]), "times_s": tuple(x["times_s"])})
                        for x in d.get("links", ())),
            collectives=tuple(CollectiveEntry(**{**x, "ranks": tuple(x["ranks"])}) for x in d.get("collectives", ())),
            tp_blocks=tuple(TpBlockTiming(**x) for x in d.get("tp_blocks", ())),
            optimizer=tuple(OptimizerTiming(**x) for x in d.get("optimizer", ())),
            pipeline_overhead=tuple(PipelineOverheadTiming(**x) for x in d.get("pipeline_overhead", ())),
        )


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# -- files ------------------------------------------------------------------------------------

def save_profile(profile: Profile, path: str) -> None:
    """Write the profile as JSON atomically (``files.write_text``: a temp file in the same
    directory, then os.replace). A failure at any point leaves the previous file (or none) in place
    and no partial file."""
    write_text(path, json.dumps(profile.to_dict(), indent=1, sort_keys=False, allow_nan=False) + "\n")


# -- the schema of a profile file --------------------------------------------------------------------

MAX_PROFILE_BYTES = 256 << 20
_RANKS = 1 << 16
_SECONDS = Num(0.0, 86400.0)                     # a spread, a latency: 0 .. one day
_POS_SECONDS = Num(0.0, 86400.0, lo_open=True)   # a measured time: more than 0
_BANDWIDTH = Num(0.0, 1e16, lo_open=True)
_BYTES = Num(0.0, float(1 << 60))
_RANK = Int(0, _RANKS - 1)
_TP = Int(1, 1 << 14)
_MBS = Int(1, 1 << 20)
_REPEATS = Int(1, 1 << 30)
_KIND = Null(Str(tuple(_catalog_names())))
"""A catalog device kind (``catalog_kind``), or null for a device outside the catalog."""
_NAME = Str(max_len=256)


def _entry(required: dict, optional: dict | None = None, what: str = "an entry") -> Dict:
    return Dict(required=required, optional=optional, what=what)


_INTERFACE = _entry({"name": _NAME}, {"speed_bytes_per_s": Null(Num(0.0, 1e16))}, "a network interface")
_HOST = _entry({"name": _NAME}, {"interfaces": List(_INTERFACE, max_len=1024), "cpu_count": Int(0, 1 << 20),
                                 "memory_bytes": _BYTES, "machine": Str(max_len=64)}, "a host")
PROFILE_SCHEMA = Dict(
    required={
        "version": Int(PROFILE_VERSION, PROFILE_VERSION),
        "provenance": _entry(
            {"hosts": List(_HOST, min_len=1, max_len=_RANKS), "device_names": List(_NAME, max_len=1024),
             "torch_version": _NAME, "backend": _NAME, "date": _NAME, "command": Str(max_len=1 << 16),
             "world_size": Int(1, _RANKS)},
            {"autoconf_version": _NAME, "notes": List(Str(max_len=1 << 16), max_len=1024)}, "the provenance"),
        "model": MODEL_SCHEMA,
        "ranks": List(_entry({"rank": _RANK, "host": _NAME, "local_rank": _RANK, "device_name": _NAME,
                              "device_kind": _KIND, "memory_bytes": _BYTES}, what="a rank"),
                      min_len=1, max_len=_RANKS),
        "compute_dtype": Str(DTYPES),
    },
    optional={
        "compute": List(_entry({"layer": Str(LAYER_KINDS), "micro_batch_size": _MBS, "tp": _TP,
                                "recompute": Str(RECOMPUTE_MODES), "forward_s": _POS_SECONDS,
                                "backward_s": _POS_SECONDS, "forward_spread_s": _SECONDS,
                                "backward_spread_s": _SECONDS, "repeats": _REPEATS, "device_kind": _KIND,
                                "rank": _RANK}, what="a layer timing")),
        "gemm": List(_entry({"m": Int(1, 1 << 30), "n": Int(1, 1 << 30), "k": Int(1, 1 << 30),
                             "dtype": Str(DTYPES + GEMM_FP8_DTYPES), "time_s": _POS_SECONDS, "flop_per_s": Num(0.0, 1e20, lo_open=True),
                             "fraction_of_peak": Null(Num(0.0, 1e3)), "device_kind": _KIND}, what="a GEMM entry")),
        "memory": List(_entry({"bytes": _BYTES, "time_s": _POS_SECONDS, "dtype": Str(DTYPES), "device_kind": _KIND},
                              what="a memory entry")),
        "activations": List(_entry({"layer": Str(LAYER_KINDS), "micro_batch_size": _MBS, "tp": _TP,
                                    "sequence_parallel": Bool(), "recompute": Str(RECOMPUTE_MODES),
                                    "bytes": _BYTES}, what="an activation entry")),
        "parameters": List(_entry({"layer": Str(LAYER_KINDS), "tp": _TP, "bytes": _BYTES,
                                   "count": Int(0, 1 << 50)}, what="a parameter entry")),
        "overhead": Null(_entry({"framework_overhead_bytes": _BYTES, "method": Str(max_len=1 << 16)},
                                {"step_peak_bytes": Map(_BYTES)}, "the memory overhead")),
        "links": List(_entry({"src": _RANK, "dst": _RANK, "latency_s": _SECONDS, "bandwidth_bytes_per_s": _BANDWIDTH,
                              "sizes_bytes": List(_BYTES, max_len=1024), "times_s": List(_SECONDS, max_len=1024)},
                             what="a link")),
        "collectives": List(_entry({"op": Str(COLLECTIVE_OPS), "ranks": List(_RANK, min_len=1, max_len=_RANKS),
                                    "bytes": _BYTES, "time_s": _POS_SECONDS, "algbw_bytes_per_s": _BANDWIDTH,
                                    "busbw_bytes_per_s": _BANDWIDTH}, what="a collective")),
        "tp_blocks": List(_entry({"micro_batch_size": _MBS, "tp": _TP, "sequence_parallel": Bool(),
                                  "forward_s": _POS_SECONDS, "backward_s": _POS_SECONDS, "repeats": _REPEATS},
                                 {"device_kind": _KIND}, "a tensor-parallel block timing")),
        "optimizer": List(_entry({"tp": _TP, "num_params": Int(1, 1 << 50), "time_s": _POS_SECONDS,
                                  "repeats": _REPEATS}, {"device_kind": _KIND}, "an optimizer timing")),
        "pipeline_overhead": List(_entry({"schedule": Str(("gpipe", "1f1b", "interleaved", "breadth_first")),
                                          "pp": Int(1, _RANKS), "virtual_stages": Int(1, 1 << 10),
                                          "num_micro_batches": Int(1, 1 << 20), "step_s": _POS_SECONDS,
                                          "per_action_s": _POS_SECONDS, "repeats": _REPEATS},
                                         what="a pipeline runtime timing")),
    },
    what="a profile")


def _check_consistency(d: dict) -> None:
    """Cross-references: ranks unique, links and collectives between ranks that exist."""
    ranks = [r["rank"] for r in d["ranks"]]
    if len(set(ranks)) != len(ranks):
        raise UserError("ranks: a rank appears twice")
    known = set(ranks)
    for i, e in enumerate(d.get("links", ())):
        if e["src"] not in known or e["dst"] not in known or e["src"] == e["dst"]:
            raise UserError(f"links[{i}]: {e['src']} -> {e['dst']} is not a link between two of the ranks "
                            f"{sorted(known)[:8]}")
        if len(e["sizes_bytes"]) != len(e["times_s"]):
            raise UserError(f"links[{i}]: {len(e['sizes_bytes'])} sizes but {len(e['times_s'])} times")
    for i, e in enumerate(d.get("collectives", ())):
        if not set(e["ranks"]) <= known:
            raise UserError(f"collectives[{i}]: ranks {sorted(set(e['ranks']) - known)[:8]} are not among the profile's ranks")


def load_profile(path: str) -> Profile:
    """Read a profile; a missing, unreadable, malformed or other-version file raises UserError."""
    if not os.path.lexists(path):  # a symlink loop or a dangling link: read_text names it
        raise UserError(f"profile {path!r} does not exist (create one with `autoconf profile --model M --out {path}`)")
    text = read_text(path, "profile", MAX_PROFILE_BYTES)
    data = parse_json(text, path, "profile", ("profile",))
    check_kind(data, path, ("profile",))
    if not isinstance(data, dict) or "version" not in data:
        raise UserError(f"profile {path!r} is not an autoconf profile (no 'version' field)")
    if data["version"] != PROFILE_VERSION or isinstance(data["version"], bool):
        if isinstance(data["version"], str) and data["version"].strip() == str(PROFILE_VERSION):
            raise UserError(f"profile {path!r} is malformed: version is the string {show_value(data['version'])}; "
                            f"expected the number {PROFILE_VERSION}")
        raise UserError(f"profile {path!r} has version {show_value(data['version'])}, this autoconf reads version "
                        f"{PROFILE_VERSION}; measure again with `autoconf profile`")
    try:
        checked = PROFILE_SCHEMA(data)
        _check_consistency(checked)
        return Profile.from_dict(checked)
    except UserError as e:
        raise UserError(f"profile {path!r} is malformed: {e}") from None


# -- matching a profile to a model ----------------------------------------------------------------

def model_differences(measured: ModelSpec, model: ModelSpec, fields=None) -> list[str]:
    """'field: measured -> wanted' for each of ``fields`` (default: every shape field) that differs."""
    names = fields or tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name != "name")
    return [f"{f}: {getattr(measured, f)!r} -> {getattr(model, f)!r}" for f in names
            if getattr(measured, f) != getattr(model, f)]


def compute_matches(profile: Profile, model: ModelSpec, layer: str) -> bool:
    """Whether the profile's timings of ``layer`` apply to ``model`` (same shapes that matter)."""
    return not model_differences(profile.model, model, COMPUTE_FIELDS[layer])


def check_profile_matches(profile: Profile, model: ModelSpec, need_compute: bool = True) -> list[str]:
    """Raise UserError when the profile's compute and memory data do not apply to ``model``.

    What may differ: the name, ``num_layers`` and ``tied_embeddings`` (per-layer data does not
    depend on them). Everything else a layer's time depends on (widths, heads, vocabulary,
    sequence length, dtype, activation, norm, bias, attention kind) must match for compute and
    memory data; link and collective data are model-independent and always usable
    (``need_compute=False`` only warns). Returns warnings (one line each) for differences allowed.
    """
    block = model_differences(profile.model, model, _BLOCK_FIELDS)
    other = sorted(set(model_differences(profile.model, model, _EMBEDDING_FIELDS + _HEAD_FIELDS)) - set(block))
    wrong = block + other
    warnings = []
    if profile.model.name != model.name and not wrong:
        warnings.append(f"profile was measured for model {profile.model.name!r}, using it for {model.name!r} "
                        "(same layer shapes)")
    if profile.model.num_layers != model.num_layers:
        warnings.append(f"profile measured {profile.model.num_layers} layers, model has {model.num_layers} "
                        "(per-layer data still applies)")
    if wrong:
        msg = _shape_mismatch(profile.model.name, model.name, wrong)
        if need_compute:
            raise UserError(msg + " (profile this model with `autoconf profile`, or use only its link data)")
        warnings.append(msg + " (only link and collective data are used)")
    return warnings


def _shape_mismatch(measured: str, wanted: str, wrong: list[str]) -> str:
    fields = ", ".join(w.split(":")[0] for w in wrong) + (" differs" if len(wrong) == 1 else " differ")
    which = f"model {measured!r}, not {wanted!r}" if measured != wanted else f"another shape of model {measured!r} ({fields})"
    return f"profile was measured for {which}: " + "; ".join(wrong) + " (profile -> model)"


def measured_device_kind(profile: Profile) -> str | None:
    """The one catalog device kind the profile's ranks ran on; None for several, or none known."""
    kinds = {r.device_kind for r in profile.ranks} - {None}
    return kinds.pop() if len(kinds) == 1 else None


def check_profile_devices(profile: Profile, device_kinds, how: str = "a cluster file of it", allow: str = "") -> None:
    """Refuse a profile of a device kind the cluster lacks (its links would replace the cluster's,
    e.g. loopback for NVLink). ``how``: how to plan on its kind; ``allow``: the flag accepting it."""
    kind = measured_device_kind(profile)
    if kind in {base_device(k) for k in device_kinds}:  # a power-capped or re-clocked kind is measured
        return
    msg = (f"--profile was measured on {kind or 'several device kinds'}; the cluster's devices are "
           f"{', '.join(device_kinds)}: profile that device kind, or plan on it ({how})")
    raise UserError(msg + (f"; or pass {allow} to use its links on these devices anyway" if allow else ""))


# -- helpers shared with the profiler --------------------------------------------------------------

_CUDA_NAMES = (  # (substring of torch.cuda.get_device_name, catalog name); first match wins
    ("GH200", "gh200"), ("H200", "h200"), ("MI325X", "mi325x"), ("MI300X", "mi300x"),
    ("H100 PCIe", "h100-pcie"),
    ("H100 NVL", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("L40S", "l40s"),
)


def catalog_kind(device_name: str, memory_bytes: float = 0.0) -> str | None:
    """The catalog name of a device as torch names it ('cpu' for CPU), or None if unknown."""
    if device_name == "cpu":
        return "cpu"
    for needle, kind in _CUDA_NAMES:
        if needle in device_name:
            return kind
    if "V100" in device_name:
        return "v100-32gb" if memory_bytes > 20 * 2**30 or "32GB" in device_name else "v100-16gb"
    if "A100" in device_name:
        return "a100-80gb" if memory_bytes > 48 * 2**30 or "80GB" in device_name else "a100-40gb"
    return None


def fit_alpha_beta(sizes_bytes, times_s) -> tuple[float, float]:
    """Fit t = a + s / b to (size, time) points: a from the quickest message, b from the large ones.

    The latency a is the quickest message's time less its own transfer time (a tiny message's
    time is its latency); the bandwidth b is the bytes of the larger half of the sizes (at least
    two) over their time beyond that latency, sum(s) / sum(t - a). A single fit over every size would let
    small messages steer the bandwidth (a shaped link lets a message that fits in its token bucket
    through at line rate; a descheduled rank adds milliseconds to a tiny message), and a slope
    between two large sizes amplifies their noise. Returns (a, b); a >= 0, b > 0. With one size:
    a = 0, b = s / t.
    """
    pts = sorted((float(s), float(t)) for s, t in zip(sizes_bytes, times_s) if t > 0)
    if not pts:
        raise ValueError("fit_alpha_beta needs at least one positive time")
    sizes = sorted({s for s, _ in pts})
    if len(sizes) == 1:
        s, t = max(pts)
        return 0.0, s / t if s > 0 else float("inf")
    cut = sizes[len(sizes) // 2] if len(sizes) >= 3 else sizes[-1]
    large = [p for p in pts if p[0] >= cut]
    # the quickest message fixes the latency (no message takes less; on a noisy machine that need
    # not be the smallest one)
    s0, t0 = min(pts, key=lambda p: (p[1], p[0]))
    a, b = t0, float("inf")
    for _ in range(3):  # take that message's own transfer time out of the latency
        beyond = sum(t - a for _, t in large)
        if beyond <= 0:  # the large messages took no longer than the latency: no bandwidth to see
            s_max, t_max = max(pts)
            return min(t for _, t in pts), s_max / t_max
        b = sum(s for s, _ in large) / beyond
        a = max(0.0, t0 - s0 / b)
    return a, b


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    if n <= 1:
        return 1.0
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
