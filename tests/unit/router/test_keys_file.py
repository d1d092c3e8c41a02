"""A keys file the router cannot use is refused at startup with a message naming the file
and what is wrong: limits that are not whole numbers (which int() would silently change,
or crash on), a file that is not UTF-8, a key two tenants share."""

from __future__ import annotations

import pytest

from omnibus.router.admission.auth import KeyStore, cache_salt
from omnibus.router.config import TenantLimits


def _open(tmp_path, text: str | bytes) -> KeyStore:
    path = tmp_path / "keys.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return KeyStore.open(str(path), TenantLimits(max_concurrent=4))


@pytest.mark.parametrize("field, value, shown", [
    ("max_concurrent", "2.7", "2.7"),
    ("max_concurrent", "true", "True"),
    ("max_concurrent", '"5"', "'5'"),
    ("tokens_per_minute", "1e400", "inf"),  # int() of it: OverflowError, a traceback
    ("tokens_per_minute", "1e20", "100000000000000000000"),
])  # fmt: skip
def test_limits_must_be_whole_numbers(tmp_path, field, value, shown):
    with pytest.raises(ValueError) as err:
        _open(tmp_path, f'{{"tenants": {{"a": {{"keys": ["k"], "{field}": {value}}}}}}}')
    assert str(err.value) == (
        f"keys file {tmp_path / 'keys.json'}, tenant 'a': '{field}' must be a whole number up to "
        f"2**53 (0: no limit), got {shown}"
    )


def test_whole_numbers_written_as_floats_are_taken_and_absent_limits_are_the_defaults(tmp_path):
    store = _open(tmp_path, '{"tenants": {"a": {"keys": ["k"], "tokens_per_minute": 6e4}}}')
    (tenant,) = store.tenants
    assert tenant.limits == TenantLimits(max_concurrent=4, tokens_per_minute=60000)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    with pytest.raises(ValueError) as err:
        _open(tmp_path, b'\xff{"tenants": {}}')
    assert str(err.value).startswith(f"cannot read keys file {tmp_path / 'keys.json'}: 'utf-8' codec")


@pytest.mark.parametrize("tenants, whose", [
    ('"a": {"keys": ["k"]}, "b": {"keys": ["x", "k"]}', "tenants 'a' and 'b'"),
    ('"a": {"keys": ["k", " k"]}', "tenant 'a'"),
])  # fmt: skip
def test_a_key_used_twice_names_whose_it_is(tmp_path, tenants, whose):
    with pytest.raises(ValueError) as err:
        _open(tmp_path, f'{{"tenants": {{{tenants}}}}}')
    assert str(err.value) == f"keys file {tmp_path / 'keys.json'}: a key is used twice, by {whose}"


@pytest.mark.parametrize("text, twice", [
    ('{"tenants": {"a": {"keys": ["k1"]}, "a": {"keys": ["k2"]}}}', "'a' appears"),
    ('{"tenants": {"a": {"keys": ["k1"], "weight": 1, "weight": 2}}}', "'weight' appears"),
])  # fmt: skip
def test_a_name_twice_in_one_object_is_refused(tmp_path, text, twice):
    """JSON keeps the last of a duplicate: a tenant listed twice silently lost its first
    entry's keys (they answered UNAUTHENTICATED)."""
    with pytest.raises(ValueError) as err:
        _open(tmp_path, text)
    assert str(err.value) == f"cannot read keys file {tmp_path / 'keys.json'}: {twice} twice in one object"


def test_tenants_share_a_cache_salt_only_within_a_cache_group(tmp_path):
    """Each keys-file tenant's prefix-cache salt is a digest of its cache_group, else of its
    name: tenants of one group share it, every other tenant has its own (a group named as
    a tenant included), the same on every router; without a keys file there is none."""
    store = _open(tmp_path, '{"tenants": {"a": {"keys": ["ka"], "cache_group": "team"}, '
                            '"b": {"keys": ["kb"]}, "c": {"keys": ["kc"], "cache_group": "team"}, '
                            '"d": {"keys": ["kd"], "cache_group": "b"}}}')
    salt = {t.name: t.cache_salt for t in store.tenants}
    assert salt["a"] == salt["c"] == cache_salt("a", "team") == cache_salt("anyone", "team")
    assert len({salt["a"], salt["b"], salt["d"]}) == 3 and salt["b"] == cache_salt("b", None)
    assert salt["b"] == "5820683fa4f99d20dcf4ad7e024eca00"  # a fixed digest: routers agree across restarts
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in salt.values())
    assert KeyStore.open(None, TenantLimits()).authenticate([]).cache_salt == ""


@pytest.mark.parametrize("value", ['""', "1", "null", '["team"]'])
def test_a_cache_group_must_be_a_non_empty_string(tmp_path, value):
    with pytest.raises(ValueError) as err:
        _open(tmp_path, f'{{"tenants": {{"a": {{"keys": ["k"], "cache_group": {value}}}}}}}')
    shown = {'""': "''", "1": "1", "null": "None", '["team"]': "['team']"}[value]
    assert str(err.value) == (f"keys file {tmp_path / 'keys.json'}, tenant 'a': 'cache_group' must be a "
                              f"non-empty string, got {shown}")
