"""bench/modern_stacks.py on the repository's copy of the runs: every row is read, then either
priced or reported as not expressible with its reason (none dropped), and the summary's counts add
up. The accuracy itself is the bench's to report, not a test's."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("modern_stacks", os.path.join(ROOT, "bench", "modern_stacks.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["modern_stacks"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def out(bench):
    return bench.run(with_sensitivity=False)


def test_every_row_is_read_with_a_known_source_model_and_layout(bench):
    rows = bench.load_rows()
    assert len(rows) == 89
    assert [r["id"] for r in rows] == list(range(1, 90))
    for r in rows:
        assert r["src"] in bench.SOURCES and r["kind"] in bench.KINDS
        assert r["model"] in bench.PRESETS or r["model"] in bench.HF_SHAPES, r["model"]
        assert r["system"] in bench.SYSTEMS
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == r["n"], r  # the layout covers the GPUs
        assert r["meas"] > 0


def test_every_row_is_priced_or_not_expressible_with_a_reason(bench, out):
    for r in out["rows"]:
        x = r["result"]
        assert x["status"] in ("priced", "not expressible"), r["id"]
        if x["status"] == "not expressible":
            assert x["reason"] and "\n" not in x["reason"] and bench.short_reason(x["reason"])
            continue
        assert math.isfinite(x["predicted_s"]) and x["predicted_s"] > 0
        assert x["error"] == pytest.approx(x["predicted_s"] / r["meas"] - 1)
        assert sum(x["breakdown_s"].values()) == pytest.approx(x["predicted_s"], rel=1e-6)
        assert sum(x["weights"]) == pytest.approx(1.0)
        for c in x["configs"]:  # the row's own layout and batch
            assert (c["dp"], c["tp"], c["pp"], c.get("cp", 1), c.get("ep", 1)) == \
                (r["dp"], r["tp"], r["pp"], r["cp"], r["ep"])
            assert c["dp"] * c["micro_batch_size"] * c["num_micro_batches"] == r["gbs"]


def test_the_summary_counts_add_up(bench, out):
    rows, s = out["rows"], out["summary"]
    priced = [r for r in rows if r["result"]["status"] == "priced"]
    assert s["all"]["rows"] == len(rows) == 89
    assert s["all"]["expressible"] == len(priced)
    assert s["all"]["false_oom"] == sum(not r["result"]["fits"] for r in priced)
    for by in ("source", "kind"):
        for key in ("rows", "expressible", "false_oom"):
            assert sum(v[key] for v in s[by].values()) == s["all"][key], (by, key)
    assert s["all"]["max_abs_error"] == max(abs(r["result"]["error"]) for r in priced)


def test_the_open_settings_touch_rows_and_change_nothing_assumed(bench, out):
    """Each alternative of an open setting differs from the assumption, and pricing a row again
    under the assumption gives the same estimate (deterministic)."""
    for _setting, _assumed, alts, touches in bench.VARIANTS:
        assert any(touches(r) for r in out["rows"])
        for _label, fields in alts:
            assert fields
    r = next(r for r in out["rows"] if r["result"]["status"] == "priced")
    assert bench.price(r)["predicted_s"] == r["result"]["predicted_s"]
