"""The cache of parsed rule files: a second load parses nothing it has seen, an edited file is parsed again, a
file that does not parse reports its error every time, and a cache that cannot be read or written changes no
result."""

from __future__ import annotations

import datetime
import tomllib
from pathlib import Path

import pytest

from logtriage.catalog import loader
from logtriage.catalog.loader import load_catalog
from logtriage.catalog.matcher import Matcher
from logtriage.catalog.parse_cache import CACHE_ENV, ParseCache, text_key

RULE = """id = "team.flaky_nfs"
title = "{title}"
category = "environment"
role = "root_candidate"
patterns = ['lustre: client evicted']
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where


def _no_parsing(monkeypatch) -> None:
    def refuse(text):
        raise AssertionError("parsed a rule file the cache holds")
    monkeypatch.setattr(loader.tomllib, "loads", refuse)


def _ids_and_titles(catalog) -> list[tuple[str, str]]:
    return [(c.rule.id, c.rule.title) for c in catalog.rules]


def test_second_load_of_the_builtin_catalog_parses_nothing_and_is_the_same(cache_dir, monkeypatch):
    first = load_catalog()
    assert len(list(cache_dir.glob("rules-*.json"))) == 1
    _no_parsing(monkeypatch)
    second = load_catalog()
    assert second.problems == first.problems == ()
    assert [c.rule for c in second.rules] == [c.rule for c in first.rules]
    assert Matcher(second).match("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")[0].rule.id \
        == "cuda.oom"


def test_an_edited_rule_file_is_parsed_again(cache_dir, tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "nfs.toml").write_text(RULE.format(title="NFS went away"))
    assert load_catalog([rules]).get("team.flaky_nfs").title == "NFS went away"
    (rules / "nfs.toml").write_text(RULE.format(title="The NFS client was evicted"))
    assert load_catalog([rules]).get("team.flaky_nfs").title == "The NFS client was evicted"


def test_a_file_that_does_not_parse_is_reported_on_every_load(cache_dir, tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "bad.toml").write_text('id = "team.bad"\ntitle = "unclosed\n')
    for _ in range(2):
        problems = load_catalog([rules]).problems
        assert len(problems) == 1 and f"{rules / 'bad.toml'}:" in problems[0] and "invalid TOML" in problems[0]


def test_a_damaged_cache_file_is_ignored_and_rewritten(cache_dir, monkeypatch):
    expected = _ids_and_titles(load_catalog())
    (cached,) = cache_dir.glob("rules-*.json")
    cached.write_bytes(b'{"format": 1, "files": {"x": ')
    assert _ids_and_titles(load_catalog()) == expected
    _no_parsing(monkeypatch)
    assert _ids_and_titles(load_catalog()) == expected


def test_an_empty_cache_variable_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_catalog().problems == ()
    assert not any(tmp_path.rglob("rules-*.json"))


def test_a_cache_that_cannot_be_written_changes_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would be\n")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    catalog = load_catalog()
    assert catalog.problems == () and catalog.get("gloo.timeout") is not None


def test_only_tables_that_survive_json_are_kept(tmp_path):
    cache = ParseCache(tmp_path / "rules", root=tmp_path / "cache")
    plain = tomllib.loads('id = "a"\ncount = 3\nratio = 0.5\nflag = true\nitems = ["x", {y = 1}]\n')
    dated = tomllib.loads('id = "b"\nwhen = 2026-12-07\n')
    wide = {"id": "c", "big": 2 ** 70}
    assert isinstance(dated["when"], datetime.date)
    for name, table in (("a", plain), ("b", dated), ("c", wide)):
        cache.put(name, text_key(name), table)
    cache.save()
    again = ParseCache(tmp_path / "rules", root=tmp_path / "cache")
    assert again.get("a", text_key("a")) == plain
    assert again.get("b", text_key("b")) is None and again.get("c", text_key("c")) is None
    assert again.get("a", text_key("changed text")) is None
