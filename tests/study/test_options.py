"""search's options object: each field documented once, and keyword overrides replace its fields."""

from __future__ import annotations

import dataclasses

from autoconf import SearchOptions, load_cluster, preset, search

CLUSTER = load_cluster("examples/clusters/localhost-cpu.yaml")


def test_options_and_keyword_overrides_are_the_same_search():
    a = search(preset("tiny"), CLUSTER, 8, SearchOptions(top=3, gpus=2, precision="bf16"))
    b = search(preset("tiny"), CLUSTER, 8, top=3, gpus=2, precision="bf16")
    c = search(preset("tiny"), CLUSTER, 8, SearchOptions(top=1, gpus=2), top=3, precision="bf16")
    for r in (b, c):
        assert [e.config for e in r.top] == [e.config for e in a.top]
        assert [e.step_time_s for e in r.top] == [e.step_time_s for e in a.top]
    assert len(a.top) == 3 and a.study_name == b.study_name == c.study_name


def test_every_option_has_its_docstring():
    import ast
    import inspect

    import autoconf.study.options as mod
    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SearchOptions")
    body = cls.body
    documented = {body[i].target.id for i in range(len(body) - 1)
                  if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)}
    assert documented == {f.name for f in dataclasses.fields(SearchOptions)}
