"""Hostile inputs: every file kind autoconf reads, mutated, must give one line and exit 2.

Most examples run the loaders in-process (they must return the spec or raise UserError with a
one-line message, nothing else); a few dozen run the real CLI in a subprocess (one line on stderr,
exit 2, no traceback, no file written). Kinds: model YAML, Hugging Face config.json, cluster YAML,
profile JSON, calibration JSON, the launch plan's config.json (``autoconf trial --config``).

``SEEN`` counts the distinct inputs tried (the last test prints it; bench/RESULTS.md records it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from autoconf.cost.calibration import load_calibration
from autoconf.errors import UserError
from autoconf.launch.plan import LaunchPlan
from autoconf.launch.plan import load as load_plan
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import load_cluster
from autoconf.specs.hf import load_model
from autoconf.specs.model import preset
from autoconf.specs.profile import load_profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEN: set[str] = set()
_COUNTER = iter(range(10**9))
FUZZ = settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "300")), deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def _read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


HF = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 128,
      "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False}
CLUSTER = yaml.safe_load(_read("examples/clusters/two-kinds.yaml"))
CPU_CLUSTER = yaml.safe_load(_read("examples/clusters/localhost-cpu.yaml"))
PLAN = LaunchPlan(ParallelConfig(dp=2, pp=1, tp=1, micro_batch_size=2, num_micro_batches=2), preset("tiny"),
                  load_cluster(os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml"))).to_dict()

# kind -> (valid data, file suffix, format, loader)
KINDS = {
    "model": (yaml.safe_load(_read("examples/models/bench-h256.yaml")), ".yaml", "yaml", load_model),
    "hf": (HF, ".json", "json", load_model),
    "cluster": (CLUSTER, ".yaml", "yaml", load_cluster),
    "profile": (json.loads(_read("examples/profiles/bench-h256-cpu2.json")), ".json", "json", load_profile),
    "calibration": ({"version": 1, "factors": {"compute": 1.2, "tp_comm": 0.8, "activations": 1.1},
                     "num_trials": 3}, ".json", "json", load_calibration),
    "plan": (PLAN, ".json", "json", load_plan),
}
ACCEPTS = {"model": {"model", "hf"}, "hf": {"model", "hf"}, "cluster": {"cluster"}, "profile": {"profile"},
           "calibration": {"calibration"}, "plan": {"plan"}}


def _all_keys(x, out):
    if isinstance(x, dict):
        for k, v in x.items():
            out.add(k)
            _all_keys(v, out)
    elif isinstance(x, list):
        for v in x:
            _all_keys(v, out)
    return out


KNOWN_KEYS = set()
for _d, *_ in KINDS.values():
    _all_keys(_d, KNOWN_KEYS)
KNOWN_KEYS |= {"norm", "position_embedding", "attention", "dropout", "name", "memory", "nics", "latency", "kind",
               "count", "bandwidth", "inter_group_bandwidth", "intra_node", "inter_node", "n_layer", "n_embd",
               "n_head", "n_inner", "n_ctx", "n_positions", "d_model", "ffn_dim", "n_head_kv", "dtype",
               "activation", "activation_function", "num_layers", "seq_length", "version", "num_trials",
               "schedule", "virtual_stages", "zero_stage", "seed", "estimate", "created_by", "profile"}


def _nodes(x, path=()):
    """(path, value) of every node below the root; the plan's free-form estimate is not an input."""
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
    for k, v in items:
        if k == "estimate" or k == "step_peak_bytes":
            continue
        yield path + (k,), v
        yield from _nodes(v, path + (k,))


NODES = {kind: list(_nodes(d)) for kind, (d, *_) in KINDS.items()}


def _dump(data, fmt) -> bytes:
    if fmt == "yaml":
        return yaml.safe_dump(data, sort_keys=False).encode()
    return json.dumps(data).encode()


def _load(kind, content: bytes, tmp_path, suffix=None):
    """Write ``content`` and run the kind's loader: returns the spec, or the UserError's message."""
    SEEN.add(hashlib.sha256(kind.encode() + content).hexdigest())
    d = tmp_path / f"k{next(_COUNTER)}"
    d.mkdir()
    path = d / ("input" + (suffix or KINDS[kind][1]))
    path.write_bytes(content)
    try:
        return KINDS[kind][3](str(path))
    except UserError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 1000, msg
        return e
    finally:
        assert os.listdir(d) == [path.name], "a loader wrote a file"


def _refused(kind, content, tmp_path, suffix=None) -> str:
    got = _load(kind, content, tmp_path, suffix)
    assert isinstance(got, UserError), f"accepted: {content[:300]!r}"
    return str(got)


def _typo(key: str, i: int) -> str:
    i %= len(key)
    return key[:i] + key[i + 1:] if i % 2 else key[:i] + key[i] + key[i:]  # drop or double one character


def _retypes(value):
    """(replacement, must_refuse) for a leaf: wrong types, non-finite and absurd numbers."""
    if isinstance(value, bool):
        return [(str(value).lower(), True), (int(value), True), (None, False), ([value], True)]
    if isinstance(value, (int, float)):
        return [(str(value), True), (math.nan, True), (math.inf, True), (-math.inf, True), (True, True),
                (10**40, True), (1e300, True), (-value - 1, False), (0, False), ([value], True), ({}, True)]
    if isinstance(value, str):
        return [(123, True), (True, True), (1.5, True), ([value], True), (None, False), (value * 300, False),
                ("", False)]
    if value is None:
        return [("x", False), (0, False), ([], False)]
    return [("x", True), (7, True), ([] if isinstance(value, dict) else {}, False), (None, False)]


def _parent(data, path):
    for k in path[:-1]:
        data = data[k]
    return data


# -- in-process fuzz: structured mutations ------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
def test_valid_seed_loads(kind, tmp_path):
    data, _, fmt, _ = KINDS[kind]
    assert not isinstance(_load(kind, _dump(data, fmt), tmp_path), UserError)


@pytest.mark.parametrize("kind", sorted(KINDS))
@FUZZ
@given(data=st.data())
def test_mutated_fields(kind, data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(kind)
    seed, _, fmt, _ = KINDS[kind]
    path, value = data.draw(st.sampled_from(NODES[kind]), label="node")
    op = data.draw(st.sampled_from(["drop", "rename", "retype", "add"]), label="op")
    doc = copy.deepcopy(seed)
    parent, key = _parent(doc, path), path[-1]
    must = False
    if op == "drop":
        del parent[key]
    elif op == "rename":
        assume(isinstance(parent, dict))
        new = _typo(key, data.draw(st.integers(0, 64)))
        assume(new not in KNOWN_KEYS and new)
        parent[new] = parent.pop(key)
        must = True
    elif op == "add":
        node = parent[key]
        target = node if isinstance(node, dict) else parent if isinstance(parent, dict) else None
        assume(target is not None)
        new = data.draw(st.sampled_from(["bandwith", "intra", "nic", "extra", "hidden", "Count", "latency_us",
                                         "num_layer", "factor", "tp_com"]))
        assume(new not in target)
        target[new] = 1
        must = kind != "hf" or new == "num_layer"  # a config.json has many keys; near-misses are refused
    else:
        replacement, must = data.draw(st.sampled_from(_retypes(value)))
        parent[key] = replacement
    got = _load(kind, _dump(doc, fmt), tmp)
    if must:
        assert isinstance(got, UserError), f"{kind}: {op} at {path} accepted"


@pytest.mark.parametrize("kind", sorted(KINDS))
@FUZZ
@given(data=st.data())
def test_mangled_bytes(kind, data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(kind)
    seed, _, fmt, _ = KINDS[kind]
    text = _dump(seed, fmt)
    op = data.draw(st.sampled_from(["truncate", "splice", "binary", "nul", "bom"]))
    if op == "truncate":
        content = text[:data.draw(st.integers(0, len(text) - 1))]
    elif op == "splice":
        i = data.draw(st.integers(0, len(text)))
        content = text[:i] + data.draw(st.binary(min_size=1, max_size=8)) + text[i + 1:]
    elif op == "binary":
        content = data.draw(st.binary(min_size=1, max_size=512)) + b"\xff\x00"
    elif op == "nul":
        i = data.draw(st.integers(0, len(text)))
        content = text[:i] + b"\x00" + text[i:]
    else:
        content = b"\xef\xbb\xbf" + text
    got = _load(kind, content, tmp)
    if op in ("binary", "nul"):
        assert isinstance(got, UserError)


# -- in-process: named hostile inputs -------------------------------------------------------------------

def _billion_laughs(levels=9, width=10):
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    lines.append(f"num_layers: *a{levels - 1}")
    return ("\n".join(lines) + "\n").encode()


def _cluster(**group):
    d = copy.deepcopy(CPU_CLUSTER)
    d["node_groups"][0].update(group)
    return yaml.safe_dump(d).encode()


def _model(**fields):
    d = copy.deepcopy(KINDS["model"][0])
    d.update(fields)
    return yaml.safe_dump(d).encode()


def _profile(fn):
    d = copy.deepcopy(KINDS["profile"][0])
    fn(d)
    return json.dumps(d).encode()


NAMED = {
    "model dropout string": ("model", _model(dropout="0.1"), "dropout"),
    "model tied string": ("model", _model(tied_embeddings="false"), "tied_embeddings"),
    "model huge layers": ("model", _model(num_layers=1_000_000_000), "num_layers"),
    "model float layers": ("model", _model(num_layers=4.0), "num_layers"),
    "model alias bomb": ("model", _billion_laughs(), "alias"),
    "model recursive alias": ("model", b"a: &a [*a]\n", "recursive"),
    "model deep nesting": ("model", b"[" * 100_000 + b"]" * 100_000, "nested"),
    "model huge int literal": ("model", _model() + b"vocab_size: " + b"9" * 5000 + b"\n", ""),
    "hf dtype string bool": ("hf", json.dumps({**HF, "tie_word_embeddings": "false"}).encode(), "tie_word_embeddings"),
    "hf misspelled key": ("hf", json.dumps({**HF, "num_key_value_head": 1}).encode(), "did you mean"),
    "hf unknown dtype": ("hf", json.dumps({**HF, "torch_dtype": "float8"}).encode(), "float8"),
    "hf deep nesting": ("hf", b"[" * 100_000 + b"]" * 100_000, "nested"),
    "hf huge int literal": ("hf", b'{"hidden_size": ' + b"9" * 5000 + b"}", ""),
    "cluster bare bandwidth": ("cluster", _cluster(intra_node_bandwidth=300), "unit"),
    "cluster nan bandwidth": ("cluster", _cluster(intra_node_bandwidth=".nan"), "bandwidth"),
    "cluster inf bandwidth": ("cluster", _cluster(intra_node_bandwidth="1e999 GB/s"), "finite"),
    "cluster zero bandwidth": ("cluster", _cluster(intra_node_bandwidth="0 GB/s"), "range"),
    "cluster absurd bandwidth": ("cluster", _cluster(intra_node_bandwidth="1e12 TB/s"), "range"),
    "cluster nics bandwith": ("cluster", _cluster(nics={"count": 1, "bandwith": "1 Gbit/s"}), "did you mean 'bandwidth'"),
    "cluster nics count true": ("cluster", _cluster(nics={"count": True, "bandwidth": "1 Gbit/s"}), "count"),
    "cluster huge gpus": ("cluster", _cluster(gpus_per_node=1_000_000_000), "gpus_per_node"),
    "cluster too many devices": ("cluster", _cluster(count=600000, gpus_per_node=8), "devices"),
    "cluster bare memory": ("cluster", _cluster(memory=4e9), "unit"),
    "cluster latency intra": ("cluster", yaml.safe_dump({**CPU_CLUSTER, "latency": {"intra": "2 us"}}).encode(),
                              "did you mean 'intra_node'"),
    "cluster absurd latency": ("cluster", yaml.safe_dump({**CPU_CLUSTER, "latency": {"intra_node": "3 h"}}).encode(),
                               "latency"),
    "cluster latency bare": ("cluster", yaml.safe_dump({**CPU_CLUSTER, "latency": {"inter_node": 1e-5}}).encode(),
                             "unit"),
    "cluster alias bomb": ("cluster", _billion_laughs(), "alias"),
    "profile string time": ("profile", _profile(lambda d: d["compute"][0].update(forward_s="0.1")), "forward_s"),
    "profile nan time": ("profile", _profile(lambda d: d["compute"][0].update(backward_s=math.nan)), "backward_s"),
    "profile negative time": ("profile", _profile(lambda d: d["compute"][0].update(forward_s=-1.0)), "forward_s"),
    "profile zero bandwidth": ("profile", _profile(lambda d: d["links"][0].update(bandwidth_bytes_per_s=0)),
                               "bandwidth"),
    "profile null bandwidth": ("profile", _profile(lambda d: d["links"][0].update(bandwidth_bytes_per_s=None)),
                               "bandwidth"),
    "profile link to nowhere": ("profile", _profile(lambda d: d["links"][0].update(dst=99)), "links[0]"),
    "profile tp zero": ("profile", _profile(lambda d: d["compute"][0].update(tp=0)), "tp"),
    "calibration abc": ("calibration", b'{"factors": {"compute": "abc"}}', "compute"),
    "calibration nan": ("calibration", b'{"factors": {"compute": NaN}}', "compute"),
    "calibration negative": ("calibration", b'{"factors": {"compute": -1.5}}', "compute"),
    "calibration is a profile": ("calibration", json.dumps(KINDS["profile"][0]).encode(), "looks like a profile"),
    "plan bool degree": ("plan", json.dumps({**PLAN, "config": {**PLAN["config"], "dp": True}}).encode(), "dp"),
    "plan nan cluster": ("plan", json.dumps({**PLAN, "cluster": {**PLAN["cluster"], "inter_node_latency_s": math.nan}}
                                            ).encode(), "latency"),
    "plan small cluster": ("plan", json.dumps({**PLAN, "config": {**PLAN["config"], "dp": 4, "num_micro_batches": 1}}
                                              ).encode(), "devices"),
    "plan is a cluster": ("plan", json.dumps(CLUSTER).encode(), "looks like a cluster"),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_hostile_input(name, tmp_path):
    kind, content, needle = NAMED[name]
    assert needle in _refused(kind, content, tmp_path)


def test_huge_files_are_refused_unread(tmp_path):
    for kind, (_, suffix, _, _) in KINDS.items():
        path = tmp_path / f"{kind}{suffix}"
        with open(path, "wb") as f:
            f.truncate(300 << 20)  # sparse: nothing is written, nothing must be read
        SEEN.add(f"huge {kind}")
        with pytest.raises(UserError, match="bytes"):
            KINDS[kind][3](str(path))


@pytest.mark.parametrize("src", sorted(KINDS))
def test_wrong_kind_is_named(src, tmp_path):
    data, suffix, fmt, _ = KINDS[src]
    for kind in KINDS:
        if kind == "hf" or src in ACCEPTS[kind]:
            continue
        assert "looks like" in _refused(kind, _dump(data, fmt), tmp_path, suffix=suffix)


# -- the real CLI ------------------------------------------------------------------------------------------

def _write(tmp_path, name, content: bytes) -> str:
    p = tmp_path / "in" / name
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(content)
    return str(p)


CLI_CASES = [  # (id, file name, content, how the CLI gets it)
    ("binary model", "m.yaml", os.urandom(64) + b"\x00", "model"),
    ("binary hf", "config.json", b"\x89PNG\r\n\x1a\n\x00", "model"),
    ("binary cluster", "c.yaml", b"\xff\xfe\x00garbage", "cluster"),
    ("binary profile", "p.json", b"\x00" * 64, "profile"),
    ("binary calibration", "cal.json", b"\xde\xad\xbe\xef", "calibration"),
    ("binary plan", "config.json", b"PK\x03\x04\x00\x00", "plan"),
    ("dropout string", "m.yaml", NAMED["model dropout string"][1], "model"),
    ("tied string", "m.yaml", NAMED["model tied string"][1], "model"),
    ("huge layers", "m.yaml", NAMED["model huge layers"][1], "model"),
    ("model alias bomb", "m.yaml", _billion_laughs(), "model"),
    ("cluster alias bomb", "c.yaml", _billion_laughs(), "cluster"),
    ("huge gpus", "c.yaml", NAMED["cluster huge gpus"][1], "cluster"),
    ("nan bandwidth", "c.yaml", NAMED["cluster nan bandwidth"][1], "cluster"),
    ("bare bandwidth", "c.yaml", NAMED["cluster bare bandwidth"][1], "cluster"),
    ("bandwith typo", "c.yaml", NAMED["cluster nics bandwith"][1], "cluster"),
    ("latency intra", "c.yaml", NAMED["cluster latency intra"][1], "cluster"),
    ("nics count true", "c.yaml", NAMED["cluster nics count true"][1], "cluster"),
    ("absurd latency", "c.yaml", NAMED["cluster absurd latency"][1], "cluster"),
    ("profile string time", "p.json", NAMED["profile string time"][1], "profile"),
    ("profile nan time", "p.json", NAMED["profile nan time"][1], "profile"),
    ("profile negative time", "p.json", NAMED["profile negative time"][1], "profile"),
    ("profile null bandwidth", "p.json", NAMED["profile null bandwidth"][1], "profile"),
    ("calibration abc", "cal.json", NAMED["calibration abc"][1], "calibration"),
    ("calibration nan", "cal.json", NAMED["calibration nan"][1], "calibration"),
    ("calibration negative", "cal.json", NAMED["calibration negative"][1], "calibration"),
    ("profile as calibration", "cal.json", NAMED["calibration is a profile"][1], "calibration"),
    ("deep nesting", "config.json", b"[" * 100_000, "model"),
    ("plan bool degree", "config.json", NAMED["plan bool degree"][1], "plan"),
    ("plan nan latency", "config.json", NAMED["plan nan cluster"][1], "plan"),
    ("plan is a cluster", "config.json", NAMED["plan is a cluster"][1], "plan"),
    ("truncated plan", "config.json", json.dumps(PLAN).encode()[:200], "plan"),
    ("truncated profile", "p.json", _read("examples/profiles/bench-h256-cpu2.json").encode()[:5000], "profile"),
]


def _argv(role: str, path: str, search: bool, emit: str) -> list[str]:
    if role == "plan":
        return ["trial", "--config", path, "--steps", "2", "--warmup", "1"]
    model = path if role == "model" else os.path.join(ROOT, "examples/models/bench-h256.yaml")
    cluster = path if role == "cluster" else os.path.join(ROOT, "examples/clusters/localhost-cpu.yaml")
    args = ["search", "--storage", "none", "--emit", emit, "--trials", "5"] if search else \
        ["estimate", "--dp", "2"]
    args += ["--model", model, "--cluster", cluster, "--global-batch", "8"]
    if role == "profile":
        args += ["--profile", path]
    if role == "calibration":
        args += ["--calibration", path]
    return args


@pytest.mark.parametrize("i", range(len(CLI_CASES)), ids=[c[0] for c in CLI_CASES])
def test_cli_one_line_exit_2_nothing_written(i, tmp_path):
    name, fname, content, role = CLI_CASES[i]
    path = _write(tmp_path, fname, content)
    SEEN.add(hashlib.sha256(b"cli" + role.encode() + content).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    emit = str(work / "launch")
    argv = _argv(role, path, search=i % 3 == 0, emit=emit)
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-m", "autoconf", *argv], capture_output=True, text=True, cwd=work,
                         env=env, timeout=120)
    assert out.returncode == 2, (argv, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoconf: error: "), out.stderr
    assert os.listdir(work) == [], "the CLI wrote a file"
    assert sorted(os.listdir(tmp_path / "in")) == [fname]


def test_zz_count_distinct_inputs():
    """Run last (file order): the number of distinct inputs tried, for bench/RESULTS.md."""
    print(f"\nhostile inputs tried: {len(SEEN)} distinct")
    assert len(SEEN) > 500


@pytest.mark.parametrize("name,text,needle", [
    ("m.yaml", "name: x\nnum_layers: 4\nhidden_size: 64\nnum_layers: 8\nnum_attention_heads: 4\nvocab_size: 100\n"
     "seq_length: 32\n", "key 'num_layers' appears twice (lines 2 and 4)"),
    ("config.json", '{"model_type": "llama", "num_hidden_layers": 4, "num_hidden_layers": 8}',
     "key 'num_hidden_layers' appears twice"),
])
def test_a_key_given_twice_is_refused_not_last_wins(tmp_path, name, text, needle):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(UserError) as e:
        load_model(str(p))
    assert needle in str(e.value) and str(p) in str(e.value)
    # a YAML merge key is not a duplicate
    q = tmp_path / "merge.yaml"
    q.write_text("base: &b {a: 1}\nother:\n  <<: *b\n  b: 2\n")
    from autoconf.specs.schema import parse_yaml
    assert parse_yaml(q.read_text(), str(q)) == {"base": {"a": 1}, "other": {"a": 1, "b": 2}}


def test_an_empty_path_is_refused_at_once(tmp_path):
    """An empty --plot (an unset shell variable) would silently draw nothing: one line, exit 2.
    (A pipe is read like a file: `--model <(...)` works.)"""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.run([sys.executable, "-m", "autoconf", "estimate", "--model", "tiny", "--cluster",
                        "examples/clusters/localhost-cpu.yaml", "--global-batch", "4", "--dp", "2", "--plot", ""],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--plot '': expected a path" in p.stderr
    q = subprocess.run(["bash", "-c", f"{sys.executable} -m autoconf estimate --model <(cat "
                        "examples/models/bench-h256.yaml) --cluster examples/clusters/localhost-cpu.yaml "
                        "--global-batch 4 --dp 2 --json"], capture_output=True, text=True, env=env, timeout=60)
    assert q.returncode == 0, q.stderr


def test_profile_version_as_a_string_and_an_unknown_device_kind_name_the_file(tmp_path):
    src = json.loads(_read("examples/profiles/bench-h256-cpu2.json"))
    for change, needle in ((lambda d: d.update(version=str(d["version"])), "version is the string '1'; expected the number 1"),
                           (lambda d: d["ranks"][0].update(device_kind="tpu"), "ranks[0].device_kind='tpu' is not valid")):
        d = copy.deepcopy(src)
        change(d)
        p = tmp_path / "p.json"
        p.write_text(json.dumps(d))
        with pytest.raises(UserError) as e:
            load_profile(str(p))
        assert needle in str(e.value) and str(p) in str(e.value)
