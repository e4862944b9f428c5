"""FP8 GEMM rows of a profile: the schema, the cost model's lookup, and the profiler measuring them."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from autoconf.cost import measured
from autoconf.errors import UserError
from autoconf.specs.profile import GemmEntry, load_profile, save_profile
from tests.specs.test_profile import make_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _row(m, n, k, dtype, frac):
    return GemmEntry(m=m, n=n, k=k, dtype=dtype, time_s=1e-6, flop_per_s=1e9, fraction_of_peak=frac,
                     device_kind="cpu")


def _fp8_profile():
    p = make_profile()
    extra = (_row(32, 64, 64, "fp8_tensorwise", 0.1), _row(128, 256, 64, "fp8_tensorwise", 0.5),
             _row(32, 64, 64, "fp8_rowwise", 0.05), _row(128, 256, 64, "fp8_rowwise", 0.3))
    return dataclasses.replace(p, gemm=p.gemm + extra)


def test_fp8_rows_validate_and_round_trip(tmp_path):
    p = _fp8_profile()
    path = tmp_path / "p.json"
    save_profile(p, str(path))
    assert load_profile(str(path)) == p


def test_fp8_names_are_gemm_dtypes_only(tmp_path):
    path = tmp_path / "p.json"
    save_profile(_fp8_profile(), str(path))
    d = json.loads(path.read_text())
    assert d["gemm"][0]["dtype"] == "fp32"
    d["gemm"][0]["dtype"] = "fp8_blockwise"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match="fp8_blockwise"):
        load_profile(str(path))
    d["gemm"][0]["dtype"] = "fp32"
    d["compute_dtype"] = "fp8_rowwise"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match="fp8_rowwise"):
        load_profile(str(path))


def test_fp8_gemm_efficiency_interpolates_and_model_dtype_is_unaffected():
    p = _fp8_profile()
    assert measured.fp8_gemm_efficiency(p, "tensorwise", 32, 64, 64) == 0.1
    assert measured.fp8_gemm_efficiency(p, "rowwise", 128, 256, 64) == 0.3
    # 64x128x64: 4x the small shape's FLOPs, 1/4 the large one's, so halfway in log(FLOPs)
    assert measured.fp8_gemm_efficiency(p, "tensorwise", 64, 128, 64) == pytest.approx(0.3)
    assert measured.fp8_gemm_efficiency(p, "rowwise", 64, 128, 64) == pytest.approx(0.175)
    assert measured.fp8_gemm_efficiency(p, "rowwise", 4096, 4096, 4096) == 0.3  # clamped above
    assert measured.fp8_gemm_efficiency(make_profile(), "tensorwise", 64, 128, 64) is None
    # the model-dtype lookup sees only the model's rows, as before the fp8 rows existed
    base = make_profile()
    for shape in ((32, 64, 64), (64, 128, 64), (128, 256, 64), (1, 1, 1)):
        assert measured.gemm_efficiency(p, *shape) == measured.gemm_efficiency(base, *shape)


def test_profile_report_shows_fp8_rows_next_to_the_model_dtype():
    pytest.importorskip("rich")
    from rich.console import Console

    from autoconf.output.tables import profile_tables

    con = Console(width=200, record=True)
    for r in profile_tables(_fp8_profile()):
        con.print(r)
    lines = [ln for ln in con.export_text().splitlines() if ln.strip().startswith("32x64x64")]
    assert [ln.split()[1] for ln in lines] == ["fp32", "fp8_tensorwise", "fp8_rowwise"]


# -- the profiler ------------------------------------------------------------------------------------------

def test_fp8_shapes_and_out_dtype():
    pytest.importorskip("torch")
    import torch

    from profiler import compute

    assert compute.fp8_gemm_shapes([(32, 64, 64), (8, 64, 64), (32, 96, 40), (48, 16, 16)]) == [(32, 64, 64),
                                                                                              (48, 16, 16)]
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert compute.fp8_out_dtype("fp32", "tensorwise", cpu) == "bf16"
    assert compute.fp8_out_dtype("fp16", "rowwise", cpu) == "fp16"
    assert compute.fp8_out_dtype("fp16", "rowwise", cuda) == "bf16"
    assert compute.fp8_out_dtype("bf16", "tensorwise", cuda) == "bf16"
    for recipe in compute.FP8_RECIPES:
        assert compute.time_fp8_gemm(32, 64, 48, recipe, "bf16", cpu, repeats=2, min_sample_s=1e-4) > 0


def test_a_refused_fp8_gemm_becomes_a_note(monkeypatch):
    pytest.importorskip("torch")
    import torch

    from profiler import compute, run

    def fake(m, n, k, recipe, out, device, repeats):
        if recipe == "rowwise":
            raise RuntimeError("no rowwise kernel here\nmore text")
        return 1e-3

    monkeypatch.setattr(compute, "time_fp8_gemm", fake)
    notes = []
    items = run._fp8_items("cpu", [(32, 64, 64), (8, 8, 8)], notes)
    assert items == [(32, 64, 64, "tensorwise"), (32, 64, 64, "rowwise")]
    rows = run._time_fp8_gemms(items, "fp32", torch.device("cpu"), 2, notes, 0, lambda w: None, lambda: None)
    assert rows == [{"m": 32, "n": 64, "k": 64, "dtype": "fp8_tensorwise", "time_s": 1e-3}]
    assert any("left out" in x and "rowwise 32x64x64" in x and "RuntimeError: no rowwise kernel here" in x
               for x in notes)
    notes = []
    assert run._fp8_items("a100", [(32, 64, 64)], notes) == [] and "no FP8 peak" in notes[0]


@pytest.mark.e2e
def test_profiler_on_cpu_writes_fp8_rows(tmp_path):
    pytest.importorskip("torch")
    from autoconf.specs.devices import device_type

    out = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MASTER_PORT=str(29600 + os.getpid() % 300))
    res = subprocess.run([sys.executable, "-m", "profiler", "--model", "tiny", "--out", str(out), "--quick", "--quiet",
                          "--skip-links", "--tp", "1", "--micro-batch-sizes", "1", "--recompute", "none"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    p = load_profile(str(out))
    fp32 = {(e.m, e.n, e.k) for e in p.gemm if e.dtype == "fp32"}
    peak = device_type("cpu").peak("fp8")
    for recipe in ("tensorwise", "rowwise"):
        rows = [e for e in p.gemm if e.dtype == f"fp8_{recipe}"]
        assert rows and {(e.m, e.n, e.k) for e in rows} <= fp32
        assert all(e.time_s > 0 and e.device_kind == "cpu" for e in rows)
        assert all(e.fraction_of_peak == pytest.approx(e.flop_per_s / peak) for e in rows)
        e = rows[0]
        assert measured.fp8_gemm_efficiency(p, recipe, e.m, e.n, e.k) == e.fraction_of_peak
    assert any(n.startswith("fp8 GEMMs: torch._scaled_mm") for n in p.provenance.notes)
