"""Hostile values in the launch files: every value the loaders accept (model and cluster names,
the launch directory, the profile path, the user's script and its arguments, host names at the
edge of what ``is_host_name`` takes) goes through ``--emit`` into node-K.sh, sbatch.sh,
megatron_args.sh, torchtitan_args.sh / torchtitan.toml, ds_config.json, config.json and PLAN.md.
Each script passes ``bash -n`` and is then RUN, under stand-ins for torchrun, srun, scontrol and
python that record their argv: no injected command runs (a canary file is never created) and
each value reaches the launcher whole, as one argument. Host names the loaders must refuse are
refused, in one line, by the cluster file and by a profile."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import tomllib
from markdown_it import MarkdownIt

from autoconf.cost.estimate import estimate
from autoconf.errors import UserError
from autoconf.launch.emit import emit
from autoconf.launch.megatron import megatron_args
from autoconf.launch.plan import LaunchPlan
from autoconf.launch.plan import load as load_plan
from autoconf.launch.torchtitan import torchtitan_args
from autoconf.space.config import ParallelConfig
from autoconf.specs.cluster import cluster_from_mapping, cluster_from_profile, load_cluster
from autoconf.specs.hf import load_model
from autoconf.specs.profile import load_profile

# what an injected command would do: create CANARY (relative: in whatever directory it ran)
EVIL = "x $(touch CANARY) `touch CANARY` ;touch CANARY; && touch CANARY | > CANARY 'q\" \\ ${HOME} * ~\ntouch CANARY\t"
ARGS = [EVIL, "", " ", "--x=$(touch CANARY)", ";touch CANARY;", "-", "--", "a\nb\n", "*", "`touch CANARY`"]
EXTRA = "extra $(touch CANARY) ;touch CANARY;\n"
EDGE_HOSTS = ["0", "a" * 253, "fe80::1:2", "z_9.x-Y:"]  # what is_host_name still accepts
REFUSED_HOSTS = ["gpu-a\n", "a;b", "$(x)", "a b", "-rf", "a\x00b"]
FRAMEWORKS = ("reference", "megatron", "torchtitan", "deepspeed")
PLAN = ParallelConfig(dp=2, pp=2, tp=1, micro_batch_size=1, num_micro_batches=2)
UNSET = "\x01unset"


def _cluster(hosts=EDGE_HOSTS, name=EVIL):
    return cluster_from_mapping({"name": name, "node_groups": [
        {"count": len(hosts), "device": "a100-80gb", "gpus_per_node": 1, "intra_node_bandwidth": "300 GB/s",
         "nics": {"count": 1, "bandwidth": "100 Gbit/s"}, "hosts": list(hosts)}]})


def _model(tmp_path):
    """The tiny preset under a hostile name, through the model-file loader."""
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"name": EVIL, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                                "num_kv_heads": 4, "ffn_hidden_size": 256, "vocab_size": 512, "seq_length": 32}))
    return load_model(str(path))


def _script(tmp_path) -> str:
    d = tmp_path / "scripts $(touch CANARY) ;touch CANARY; `touch CANARY`\n"
    d.mkdir()
    path = d / "train 'q\" $(touch CANARY);x.py"
    path.write_text("raise SystemExit('the stand-in torchrun never runs this')\n")
    return str(path)


def _emit(tmp_path, framework, model, cluster=None, **kw) -> str:
    """The launch directory: spaces, quotes, $(...), backticks, ';' and a trailing newline in its name."""
    out = tmp_path / "launch" / f"{framework} $(touch CANARY) `touch CANARY` ;touch CANARY; 'q\"\n"
    cluster = cluster or _cluster()
    emit(estimate(PLAN, model, cluster, framework=framework), model, cluster, str(out),
         profile_path=f"{tmp_path}/prof $(touch CANARY);\n.json", **kw)
    return str(out)


# -- the stand-ins -----------------------------------------------------------------------------------

_RECORD = r'''i=0; while ! (set -C; : > "$RECORD/$i") 2>/dev/null; do i=$((i+1)); done
printf '%s\0' "$(basename "$0")" "$PWD" "${MASTER_ADDR-$UNSET}" "${AUTOCONF_PLAN-$UNSET}" \
  "${SLURMD_NODENAME-$UNSET}" "$@" > "$RECORD/$i"
'''
_STANDINS = {
    "torchrun": _RECORD, "python": _RECORD, "python3": _RECORD,
    # srun: its own options, then the command, run once per node (one at a time) as SLURM would
    "srun": _RECORD + 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                      'i=0; while IFS= read -r -d "" node; do SLURM_NODEID=$i SLURMD_NODENAME="$node" "$@" || exit; '
                      'i=$((i+1)); done < "$FAKE_NODES"\n',
    "scontrol": 'tr "\\0" "\\n" < "$FAKE_NODES"\n',
}


def _bin(tmp_path, nodes) -> dict:
    """The environment of a run: the stand-ins first on PATH, where they record, SLURM's node order."""
    d = tmp_path / "bin"
    d.mkdir(parents=True)
    for name, body in _STANDINS.items():
        (d / name).write_text("#!/usr/bin/env bash\nset -eu\n" + body)
        (d / name).chmod(0o755)
    (d / "record").mkdir()
    (d / "nodes").write_text("".join(n + "\0" for n in nodes))
    return {"PATH": f"{d}{os.pathsep}/usr/bin{os.pathsep}/bin", "RECORD": str(d / "record"), "UNSET": UNSET,
            "FAKE_NODES": str(d / "nodes"), "SLURM_JOB_NODELIST": "ignored", "HOME": str(tmp_path)}


def _records(env) -> list[dict]:
    out = []
    for f in sorted(os.listdir(env["RECORD"]), key=int):
        words = open(os.path.join(env["RECORD"], f), "rb").read().decode().split("\0")[:-1]
        keys = ("prog", "cwd", "MASTER_ADDR", "AUTOCONF_PLAN", "node")
        out.append({**dict(zip(keys, words)), "argv": words[len(keys):]})
    return out


def _run(env, path, *args, cwd):
    r = subprocess.run(["bash", str(path), *args], env=env, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _no_canary(tmp_path):
    assert not [str(p) for p in tmp_path.rglob("CANARY")], "an injected command ran"


def _scripts(out: str) -> list[str]:
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".sh"))


def _bash_n(path):
    r = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- what each launcher must receive ------------------------------------------------------------------

def _torchrun_options(k: int) -> list[str]:
    return ["--nnodes=4", "--nproc-per-node=1", f"--node-rank={k}", "--rdzv-backend=static",
            f"--master-addr={EDGE_HOSTS[0]}", "--master-port=29500"]


def _target(framework, model, env) -> list[str]:
    """The argv after torchrun's options when no --script is given (before the node script's own
    arguments): the framework's arrays as the emitter made them, which the shell must pass on whole."""
    plan = LaunchPlan.of_estimate(estimate(PLAN, model, _cluster(), framework=framework), model, _cluster())
    if framework == "megatron":
        return [env["MEGATRON_LM"] + "/pretrain_gpt.py", *map(str, megatron_args(plan))]
    if framework == "torchtitan":
        words, _ = torchtitan_args(plan)
        return ["-m", "torchtitan.train", "--module", "llama3", "--config", env["TORCHTITAN_CONFIG"], *map(str, words)]
    if framework == "deepspeed":
        return [env["DEEPSPEED_SCRIPT"], "--deepspeed", "--deepspeed_config", "ds_config.json"]
    return ["-m", "autoconf.trainer", "--config", "config.json", "--out", "results"]


def _framework_env(env, tmp_path) -> dict:
    return {**env, "MEGATRON_LM": f"{tmp_path}/mega $(touch CANARY) ;touch CANARY;\n", "TORCHTITAN_CONFIG": EVIL,
            "DEEPSPEED_SCRIPT": f"{tmp_path}/ds `touch CANARY`.py"}


def _check_node_runs(recs, out, want_argv):
    """Four torchrun records, one per node: host k's ranks, its options, every value whole."""
    assert [r["prog"] for r in recs] == ["torchrun"] * 4  # nothing else ran: no python, no stray command
    for k, rec in enumerate(recs):
        assert rec["argv"] == _torchrun_options(k) + want_argv(k)
        assert rec["cwd"] == out and rec["AUTOCONF_PLAN"] == os.path.join(out, "config.json")


# -- the tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_node_scripts_run_the_users_script_with_hostile_values_whole(tmp_path, framework):
    """--script in a hostile directory, hostile arguments, a hostile launch directory, model and
    cluster name: each node script, run by hand, hands torchrun every value as one argument."""
    model, script = _model(tmp_path), _script(tmp_path)
    out = _emit(tmp_path, framework, model, script=script, script_args=ARGS)
    for path in _scripts(out):
        _bash_n(path)
    env = _bin(tmp_path, EDGE_HOSTS)
    for k in range(4):
        _run(env, os.path.join(out, f"node-{k}.sh"), EXTRA, cwd=tmp_path)
    _check_node_runs(_records(env), out, lambda k: [script, *ARGS, EXTRA])
    _no_canary(tmp_path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_node_scripts_run_the_frameworks_launcher_with_its_files_sourced(tmp_path, framework):
    """Without --script: megatron_args.sh / torchtitan_args.sh (hostile names in their comments)
    are sourced and their arrays reach torchrun word for word; hostile MEGATRON_LM,
    TORCHTITAN_CONFIG and DEEPSPEED_SCRIPT stay one argument. Run from the launch directory's
    parent by a relative path, so the script itself finds its directory."""
    model = _model(tmp_path)
    out = _emit(tmp_path, framework, model)
    for path in _scripts(out):
        _bash_n(path)
    env = _framework_env(_bin(tmp_path, EDGE_HOSTS), tmp_path)
    for k in range(4):
        _run(env, os.path.join(os.path.basename(out), f"node-{k}.sh"), EXTRA, cwd=os.path.dirname(out))
    ac = [f"activation-checkpoint:{PLAN.recompute}"] if framework == "torchtitan" else []
    _check_node_runs(_records(env), out, lambda k: _target(framework, model, env) + [EXTRA] + ac)
    _no_canary(tmp_path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sbatch_runs_each_node_script_on_its_host_with_hostile_values(tmp_path, framework):
    """sbatch.sh, run from a copy elsewhere (sbatch runs a spooled copy) with SLURM listing the
    nodes in another order: every task finds its node script by host name (names at the edge of
    is_host_name), the default launch directory (a hostile path) is found, values stay whole."""
    model, script = _model(tmp_path), _script(tmp_path)
    out = _emit(tmp_path, framework, model, script=script, script_args=ARGS)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(os.path.join(out, "sbatch.sh"), spool / "sbatch.sh")
    env = _bin(tmp_path, EDGE_HOSTS[::-1])
    _run(env, spool / "sbatch.sh", cwd=spool)
    recs = _records(env)
    assert recs[0]["prog"] == "srun" and recs[0]["MASTER_ADDR"] == EDGE_HOSTS[0]
    runs = sorted(recs[1:], key=lambda r: r["argv"][2])  # by --node-rank=k
    assert [r["node"] for r in runs] == EDGE_HOSTS  # node k ran on host k, though SLURM numbered them backwards
    _check_node_runs(runs, out, lambda k: [script, *ARGS])
    _no_canary(tmp_path)


def test_sbatch_directives_are_plain_words_and_the_nodelist_names_every_host(tmp_path):
    out = _emit(tmp_path, "reference", _model(tmp_path))
    lines = open(os.path.join(out, "sbatch.sh")).read().splitlines()
    directives = [ln for ln in lines if ln.startswith("#SBATCH")]
    assert all(re.fullmatch(r"#SBATCH --[a-z-]+=[A-Za-z0-9._:,-]+", ln) for ln in directives), directives
    assert f"#SBATCH --nodelist={','.join(EDGE_HOSTS)}" in directives


def test_sbatch_leaves_out_a_nodelist_it_cannot_write_and_still_runs(tmp_path):
    """A cluster whose host names never went through the loader (built in code): sbatch reads
    #SBATCH lines unquoted, so emit checks each name again and writes a comment instead; the
    shell lines quote the names, so srun still runs every node's script with the names whole."""
    import dataclasses

    base = _cluster(["a", "b", "c", "d"], name="c")
    hosts = ("gpu-a\n#SBATCH --wrap=touch CANARY", "b;touch CANARY", "$(touch CANARY)", "-rf `touch CANARY`")
    cluster = dataclasses.replace(base, node_groups=(dataclasses.replace(base.node_groups[0], hosts=hosts),))
    model = _model(tmp_path)
    out = _emit(tmp_path, "reference", model, cluster=cluster)
    text = open(os.path.join(out, "sbatch.sh")).read()
    assert [ln for ln in text.splitlines() if ln.startswith("#SBATCH")] == [
        "#SBATCH --job-name=autoconf", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=1"]
    assert f"# no #SBATCH --nodelist: host {hosts[0]!r} is not a plain host name" in text
    env = _bin(tmp_path, hosts[::-1])
    _run(env, os.path.join(out, "sbatch.sh"), cwd=tmp_path)
    runs = sorted(_records(env)[1:], key=lambda r: r["argv"][2])
    assert [r["node"] for r in runs] == list(hosts) and all(r["MASTER_ADDR"] == hosts[0] for r in runs)
    assert [r["argv"][4] for r in runs] == [f"--master-addr={hosts[0]}"] * 4
    _no_canary(tmp_path)


def test_sourcing_the_framework_files_defines_only_their_arrays(tmp_path):
    """megatron_args.sh and torchtitan_args.sh sourced in a clean bash: the hostile names in their
    comments run nothing, and the variables they set are exactly the arrays node-K.sh uses."""
    model = _model(tmp_path)
    for framework, names in (("megatron", ["MEGATRON_ARGS"]), ("torchtitan", ["TORCHTITAN_AC", "TORCHTITAN_ARGS"])):
        path = os.path.join(_emit(tmp_path, framework, model), f"{framework}_args.sh")
        _bash_n(path)
        env = _bin(tmp_path / framework, [])
        r = subprocess.run(["bash", "-c", 'a="$(compgen -v)"; source "$1"; comm -13 <(echo "$a" | sort) '
                            '<(compgen -v | sort) | grep -Ev "^(a|PIPESTATUS)$"', "_", path], env=env, cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.split() == names, r.stderr
        assert os.listdir(env["RECORD"]) == []
    _no_canary(tmp_path)


def test_data_files_hold_hostile_values_intact(tmp_path):
    """config.json (model name, cluster name, profile path), ds_config.json's notes and
    torchtitan.toml (hostile names only in its comments) parse back; PLAN.md shows the hostile
    script path and host names each as one whole code span."""
    model, script = _model(tmp_path), _script(tmp_path)
    out = _emit(tmp_path, "deepspeed", model, script=script, script_args=ARGS)
    plan = load_plan(os.path.join(out, "config.json"))
    assert (plan.model.name, plan.cluster.name) == (EVIL, EVIL)
    assert plan.profile == f"{tmp_path}/prof $(touch CANARY);\n.json"
    notes = json.loads(open(os.path.join(out, "ds_config.json")).read())["_autoconf"]["notes"]
    assert notes[0].startswith(f"{EVIL} on {EVIL}: ")
    titan = _emit(tmp_path / "t", "torchtitan", model)
    toml = open(os.path.join(titan, "torchtitan.toml")).read()
    assert tomllib.loads(toml)["parallelism"]["pipeline_parallel_degree"] == 2
    assert all(ln.startswith("# ") for ln in toml.split("\n\n")[0].splitlines())  # names stay in comments
    spans = [t.content for tok in MarkdownIt().parse(open(os.path.join(out, "PLAN.md")).read()) if tok.children
             for t in tok.children if t.type == "code_inline"]
    assert script.replace("\n", "\\n") in spans and set(EDGE_HOSTS) <= set(spans)


@pytest.mark.parametrize("text", ["`x`", "a``b", " x", "x ", "`", "a\nb"])
def test_plan_md_code_spans_hold_any_text_whole(tmp_path, text):
    """A script path with backticks or edge spaces is one code span showing exactly the path
    (control characters escaped)."""
    d = tmp_path / "s"
    d.mkdir()
    script = d / text
    script.write_text("")
    out = _emit(tmp_path, "reference", _model(tmp_path), script=str(script))
    md = MarkdownIt().parse(open(os.path.join(out, "PLAN.md")).read())
    spans = [t.content for tok in md if tok.children for t in tok.children if t.type == "code_inline"]
    assert str(script).replace("\n", "\\n") in spans


# -- host names the loaders refuse -------------------------------------------------------------------

def _one_line_refusal(exc, bad):
    msg = str(exc.value)
    assert "\n" not in msg and repr(bad) in msg and "letters, digits" in msg, msg


@pytest.mark.parametrize("bad", REFUSED_HOSTS)
def test_the_cluster_file_refuses_a_hostile_host_name_in_one_line(tmp_path, bad):
    path = tmp_path / "c.yaml"  # JSON is YAML: escapes keep the control characters in the file's text
    path.write_text(json.dumps({"name": "c", "node_groups": [
        {"count": 2, "device": "cpu", "gpus_per_node": 1, "intra_node_bandwidth": "4 GB/s", "hosts": ["ok", bad]}]}))
    with pytest.raises(UserError) as e:
        load_cluster(str(path))
    _one_line_refusal(e, bad)
    with pytest.raises(UserError) as e:
        cluster_from_mapping(json.loads(path.read_text()))
    _one_line_refusal(e, bad)


@pytest.mark.parametrize("bad", REFUSED_HOSTS)
def test_a_profile_with_a_hostile_rank_host_is_refused_for_launch_files_in_one_line(tmp_path, bad):
    """The profile records host names as measured; the launch files take their hosts from it
    (cluster_from_profile, what search --profile --emit uses), which refuses the name."""
    d = json.loads(open("examples/profiles/bench-h256-cpu2.json").read())
    d["provenance"]["hosts"][0]["name"] = bad
    for r in d["ranks"]:
        r["host"] = bad
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        cluster_from_profile(load_profile(str(path)))
    _one_line_refusal(e, bad)


def test_the_canary_and_the_stand_ins_catch_an_unquoted_value(tmp_path):
    """The checks above can fail: an unquoted value runs its command here, and the stand-in
    torchrun records what it was given word for word."""
    env = _bin(tmp_path, [])
    (tmp_path / "bad.sh").write_text("torchrun x $(touch CANARY) 'a b'\n")
    _run(env, tmp_path / "bad.sh", cwd=tmp_path)
    assert [r["argv"] for r in _records(env)] == [["x", "a b"]]
    with pytest.raises(AssertionError, match="an injected command ran"):
        _no_canary(tmp_path)


# -- the quoting itself -------------------------------------------------------------------------------

WORDS = [EVIL, "", "'", "\\", "a\nb", "x\n", "\t\r\x0b\x0c\x1b\x7f", "é ü \u2028 \u0085", "\udcff\udc80 bytes",
         "$'x'", "\\x41", "-n", "!x"]


def test_quote_keeps_every_value_on_one_line_and_bash_reads_it_back_whole(tmp_path):
    """Each value is one word on one line (a control character as an escape), and bash, given
    the word, prints exactly the value's bytes (a path's undecodable bytes included)."""
    from autoconf.launch.shell import join, quote

    assert all("\n" not in quote(w) and "\r" not in quote(w) for w in WORDS)
    r = subprocess.run(["bash", "-c", "printf '%s\\0' " + join(WORDS)], capture_output=True, check=True)
    assert r.stdout.split(b"\0")[:-1] == [os.fsencode(w) for w in WORDS]
    with pytest.raises(UserError, match="NUL"):
        quote("a\x00b")


def test_bad_launch_values_are_one_line_errors(tmp_path):
    """Script arguments without --script, and local devices out of range on a host whose name was
    never checked: one-line UserErrors that show the values escaped."""
    import dataclasses

    model = _model(tmp_path)
    with pytest.raises(UserError) as e:
        _emit(tmp_path, "reference", model, script_args=["a\nb;c"])
    assert "\n" not in str(e.value) and "need --script" in str(e.value)
    base = _cluster()
    cluster = dataclasses.replace(base, node_groups=(dataclasses.replace(base.node_groups[0],
                                                                         hosts=("h\nx", "b", "c", "d")),))
    with pytest.raises(UserError) as e:
        _emit(tmp_path, "reference", model, cluster=cluster, local_devices=[1, 0, 0, 0])
    assert "\n" not in str(e.value) and "'h\\nx'" in str(e.value)
