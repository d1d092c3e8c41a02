"""`make bench-offline` pieces that run without the transformers peers: the host-work
measurement, served vs in process at a tiny size, and the markdown writers, which keep the
hand-written analysis (and, for a served-only run, everything but the served section)."""

from omnibus.bench.offline import (
    KEEP_MARKER,
    SERVED_MARKER,
    host_work_per_step,
    served_vs_in_process,
    write_markdown,
    write_served,
)

from tests.checkpoints import make_checkpoint


def test_host_work_is_measured_per_batch_size_and_leaves_nothing_running(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama")
    out = host_work_per_step(path, batch_sizes=(2, 5), prompt_len=8, steps=3)
    assert list(out) == [2, 5]
    for times in out.values():
        assert set(times) == {"schedule", "prepare", "update", "model"}
        assert all(v > 0 for v in times.values())


def test_rewrite_keeps_the_text_below_the_marker(tmp_path):
    doc = tmp_path / "offline.md"
    doc.write_text("# old numbers\n" + KEEP_MARKER + "\n\n## Why\nhand-written analysis\n")
    r = {"omnibus_tok_s": 500.0, "omnibus_aten_tok_s": 400.0, "hf_static_tok_s": 250.0,
         "hf_continuous_tok_s": 125.0, "vs_hf_static": 2.0, "vs_hf_static_rounds": [2.0, 2.5],
         "rounds": {"omnibus": [500.0, 600.0], "omnibus_aten": [400.0, 420.0], "hf_static": [250.0, 240.0]},
         "vs_hf_continuous": 4.0, "matmul_gflops": 180.0, "matmul_params": 18.7e6, "output_tokens": 100,
         "scheduler_ms_per_step_256": 0.7, "share_of_matmul_peak": 0.1, "share_of_matmul_peak_all_tokens": 0.3,
         "host_ms_per_decode_step": {64: {"schedule": 0.1, "prepare": 0.2, "update": 0.2, "model": 40.0}},
         "env": {"cores": 2, "torch": "x", "threads": 2}}
    write_markdown(doc, r, 64)
    text = doc.read_text()
    assert "old numbers" not in text and "| 64 | 0.10 | 0.20 | 0.20 | 0.50 | 40.0 |" in text
    assert "| 550 (500–600) | 1.00 |" in text and "| 2.00 (per round: 2.00, 2.50) |" in text
    assert text.endswith(KEEP_MARKER + "\n\n## Why\nhand-written analysis\n")


def test_served_and_in_process_run_the_same_workload(tmp_path):
    path = make_checkpoint(tmp_path / "m", "llama")
    prompts, lengths = [[5, 6, 7, 8], [9, 10, 11], [12, 13]], [3, 1, 5]
    r = served_vs_in_process(path, prompts, lengths)
    assert r["output_tokens"] == 9
    assert r["in_process_tok_s"] > 0 and r["served_tok_s"] > 0
    assert r["served_vs_in_process"] == r["served_tok_s"] / r["in_process_tok_s"]


def test_a_served_run_rewrites_only_its_section(tmp_path):
    doc = tmp_path / "offline.md"
    doc.write_text("# tables\n| Omnibus | 550 |\n" + KEEP_MARKER + "\n\n## Why\nhand-written\n")
    r = {"in_process_tok_s": 500.0, "served_tok_s": 450.0, "served_vs_in_process": 0.9,
         "output_tokens": 100, "env": {"cores": 2, "threads": 2}}
    write_served(doc, r, 64)
    write_served(doc, r | {"served_tok_s": 400.0, "served_vs_in_process": 0.8}, 64)
    text = doc.read_text()
    assert text.startswith("# tables\n| Omnibus | 550 |\n\n" + SERVED_MARKER)
    assert text.count(SERVED_MARKER) == 1 and "| 400 | 0.80 |" in text and "| 450 |" not in text
    assert text.endswith(KEEP_MARKER + "\n\n## Why\nhand-written\n")


def test_served_by_threads_interleaves_every_configuration(monkeypatch):
    import torch
    from omnibus.bench import offline

    calls = []

    def in_process(path, prompts, lengths):
        calls.append(("in", torch.get_num_threads(), {}))
        return 1.0

    def served(path, prompts, lengths, flags=()):
        calls.append(("served", torch.get_num_threads(), flags))
        return 2.0

    monkeypatch.setattr(offline, "run_omnibus", in_process)
    monkeypatch.setattr(offline, "run_served", served)
    threads = torch.get_num_threads()
    runs = offline.served_by_threads(None, [], [], rounds=2)
    assert torch.get_num_threads() == threads  # restored
    process, thread = ("--step-loop", "process"), ("--step-loop", "thread")
    one_round = [("in", 2, {}), ("served", 2, process), ("served", 2, thread),
                 ("in", 1, {}), ("served", 1, process), ("served", 1, thread)]
    assert calls == one_round * 2
    assert list(runs.values()) == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]] * 2


def test_in_process_rounds_take_turns(monkeypatch):
    """Omnibus (both CPU matmuls) and transformers static generate take turns, round by round."""
    from omnibus.bench import offline, peers

    calls = []

    def omnibus(path, prompts, lengths, *flags):
        calls.append(("omnibus", *flags))
        return 3.0 if flags else 4.0

    def hf_static(model, prompts, lengths, batch):
        calls.append(("hf", batch))
        return 1.0

    monkeypatch.setattr(offline, "run_omnibus", omnibus)
    monkeypatch.setattr(peers, "hf_static_tok_s", hf_static)
    runs = offline.in_process_rounds(None, None, [], [], rounds=3)
    first, aten, hf = ("omnibus",), ("omnibus", "--cpu-matmul", "aten"), ("hf", 16)
    assert calls == [first, aten, hf, aten, hf, first, hf, first, aten]  # each round starts one later
    assert runs == {"omnibus": [4.0] * 3, "omnibus_aten": [3.0] * 3, "hf_static": [1.0] * 3}
