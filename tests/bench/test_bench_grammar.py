"""make bench-grammar's code path at a tiny size: both engines walk random outputs of
each format and every row is measured."""

from omnibus.bench.grammar import FORMATS, markdown, measure


def test_both_engines_walk_each_format_and_the_report_has_every_row():
    result = measure([300], fills=20)
    rows = result["rows"]
    assert [(r["engine"], r["format"]) for r in rows] == [
        (engine, fmt) for fmt in FORMATS for engine in ("xgrammar", "llguidance")]
    for r in rows:
        assert r["fills"] == 20 and 0 < r["fill_us_median"] <= r["fill_us_p99"] and r["compile_ms"] > 0
    assert markdown(result).count("\n| xgrammar |") == len(FORMATS)
