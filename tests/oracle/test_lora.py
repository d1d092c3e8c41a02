"""Multi-LoRA: token-exact against PEFT, tier eviction, prefix-cache isolation, confinement."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from omnibus.common.prefix import leading_block_keys
from omnibus.engine.config import EngineConfig
from omnibus.engine.engine import AdapterError, Engine, UnknownAdapterError
from omnibus.engine.serving.async_engine import AsyncEngine
from omnibus.engine.serving.metrics import EngineMetrics
from omnibus.engine.serving.service import EngineService
from omnibus.engine.worker.sampling import SamplingParams
from omnibus.router.config import RouterConfig
from omnibus.router.dispatch.dispatcher import Ticket
from omnibus.router.dispatch.engines import EngineClient
from tests.checkpoints import hf_greedy, load_hf, make_checkpoint

ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "a-r2": (2, 4, ["q_proj", "v_proj"], False),
    "b-r8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "c-r4": (4, 8, ["o_proj", "down_proj", "up_proj"], True),
    "d-r16": (16, 8, ["k_proj", "gate_proj"], False),
}


def make_adapter(base_path, out, rank, alpha, targets, rslora, seed, **patterns):
    import peft

    torch.manual_seed(seed)
    model = load_hf(base_path)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                          init_lora_weights=False, **patterns)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # PEFT's random init is tiny; make the adapters change the outputs
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    pm.save_pretrained(out)
    return pm.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", "llama")
    adapters_dir = root / "adapters"
    oracles = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        oracles[name] = make_adapter(base, adapters_dir / name, *spec, seed=i)
    oracles[None] = load_hf(base)
    return base, adapters_dir, oracles


def expected(oracles, adapter, prompt, n):
    return hf_greedy(oracles[adapter], prompt, n)


def run(engine, requests):
    """requests: list of (adapter, prompt, max_tokens); returns outputs in order."""
    for i, (adapter, prompt, n) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                           adapter=adapter)
    out = {f"r{i}": [] for i in range(len(requests))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
    return [out[f"r{i}"] for i in range(len(requests))]


def mixed_requests(prompt_len=30, per_adapter=2, prefix=None):
    reqs = []
    names = [None, *ADAPTERS]
    for k in range(per_adapter):
        for j, name in enumerate(names):
            body = [(7 * j + 3 * k + t) % 380 + 3 for t in range(prompt_len + 5 * j)]
            reqs.append((name, (prefix or []) + body, 6 + j))
    return reqs


@pytest.mark.parametrize("max_loras,overlap", [(4, False), (2, False), (2, True)])  # 2 < 4 in use: reloads
def test_mixed_batch_matches_peft(setup, max_loras, overlap):
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir),
                                 max_loras=max_loras, max_cpu_loras=4, max_lora_rank=16,
                                 overlap_scheduling=overlap))
    reqs = mixed_requests()
    got = run(engine, reqs)
    for (adapter, prompt, n), out in zip(reqs, got):
        assert out == expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"
        if adapter is not None:  # the adapters really change the output
            assert out != expected(oracles, None, prompt, n)
    if max_loras == 2:
        assert engine.adapters.stats().evictions > 0


def test_prefix_cache_hits_stay_per_adapter(setup):
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir), max_loras=4))
    shared = [11 + (t % 300) for t in range(64)]
    reqs = mixed_requests(prompt_len=10, per_adapter=1, prefix=shared)
    first = run(engine, reqs)
    hits = engine.stats().num_prefix_cache_hit_blocks
    second = run(engine, reqs)  # now every prompt hits its own adapter's cached blocks
    assert first == second
    assert engine.stats().num_prefix_cache_hit_blocks - hits >= len(reqs) * (64 // 16)
    for (adapter, prompt, n), out in zip(reqs, second):
        assert out == expected(oracles, adapter, prompt, n)


def test_cache_never_shared_across_adapters(setup):
    base, adapters_dir, _ = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir)))
    prompt = list(range(10, 60))
    run(engine, [(None, prompt, 2)])
    hits = engine.stats().num_prefix_cache_hit_blocks
    run(engine, [("a-r2", prompt, 2), ("b-r8", prompt, 2)])
    assert engine.stats().num_prefix_cache_hit_blocks == hits  # nothing reused from the base model
    run(engine, [("a-r2", prompt, 2)])
    assert engine.stats().num_prefix_cache_hit_blocks == hits + 3  # its own blocks are reused


async def test_the_router_keys_an_adapter_prompt_as_the_engine_caches_it(setup):
    """The load report carries the salt the allocator hashed an adapter request's blocks
    with; under it, the router's keys for the prompt are exactly the blocks cached."""
    base, adapters_dir, _ = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir)))
    prompt = list(range(10, 60))  # 3 reusable blocks of 16
    run(engine, [("a-r2", prompt, 2)])
    aengine = AsyncEngine(engine)  # not started: it serves the engine's stats snapshot
    report = EngineService(aengine, EngineMetrics(aengine)).load_report()
    report.prefix_block_keys.extend(aengine.stats().prefix_block_keys)  # as WatchLoad sends them
    assert list(report.adapter_salts) == ["a-r2"]  # the only adapter whose config was read
    keys = leading_block_keys(prompt, report.block_size, report.adapter_salts["a-r2"], 64)
    assert len(keys) == 3 and set(report.prefix_block_keys) == set(keys)

    config = RouterConfig(model="m", engines=("127.0.0.1:1",))
    client = EngineClient(config.engines[0], config, lambda: None)
    try:
        client.take_report(report)
        shares = [Ticket(0, 1, 0.0, adapter=a, prompt_ids=prompt).prefix_share(client)
                  for a in ("a-r2", "b-r8", "")]
    finally:
        await client.close()
    assert shares == [48 / 50, 0.0, 0.0]  # b-r8: no salt reported; the base model: other keys


def test_adapter_loads_in_background_without_blocking_base(setup, monkeypatch):
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir)))
    import omnibus.engine.lora.manager as lora_mod

    real = lora_mod.load_adapter_weights
    gate = {"open": False}

    def slow_load(*a, **kw):
        while not gate["open"]:
            time.sleep(0.005)
        return real(*a, **kw)

    monkeypatch.setattr(lora_mod, "load_adapter_weights", slow_load)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request("lora", [5, 6, 7], params, adapter="b-r8")
    engine.add_request("base", [5, 6, 7], params)
    base_tokens = []
    for _ in range(5):
        for o in engine.step():
            assert o.request_id == "base"  # the adapter request waits; the base one streams
            base_tokens += o.new_token_ids
    assert base_tokens == expected(oracles, None, [5, 6, 7], 5)
    gate["open"] = True
    lora_tokens = []
    while engine.has_unfinished():
        for o in engine.step():
            lora_tokens += o.new_token_ids
        time.sleep(0.001)
    assert lora_tokens == expected(oracles, "b-r8", [5, 6, 7], 5)


@pytest.mark.parametrize("name,error", [
    ("../base", AdapterError),
    ("/etc", AdapterError),
    ("a" * 10_000, AdapterError),
    ("a-r2\n", AdapterError),
    ("ａ-r2", AdapterError),  # fullwidth letter
    ("a-r2/..", AdapterError),
    (".hidden", AdapterError),
    ("nope", UnknownAdapterError),
])
def test_bad_adapter_names_refused(setup, name, error):
    base, adapters_dir, _ = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir), num_kv_blocks=16))
    with pytest.raises(error):
        engine.add_request("x", [5, 6], SamplingParams(max_tokens=2), adapter=name)
    assert not engine.has_unfinished()


def test_symlink_escaping_root_opens_nothing_outside(setup, tmp_path, monkeypatch):
    base, adapters_dir, _ = setup
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "escape")
    (root / "filelink").mkdir()
    os.symlink(outside / "adapter_config.json", root / "filelink" / "adapter_config.json")
    opened = []
    real_open = open

    def spy_open(file, *a, **kw):
        opened.append(os.path.realpath(file))
        return real_open(file, *a, **kw)

    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root), num_kv_blocks=16))
    monkeypatch.setattr("builtins.open", spy_open)
    with pytest.raises(UnknownAdapterError):
        engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter="escape")
    with pytest.raises(AdapterError, match="outside the adapter's own directory"):
        engine.add_request("y", [5], SamplingParams(max_tokens=1), adapter="filelink")
    assert not any(p.startswith(str(outside.resolve())) for p in opened)


def test_pickle_rank_and_shape_refused(setup, tmp_path):
    base, adapters_dir, _ = setup
    root = tmp_path / "root"
    pick = root / "pickled"
    pick.mkdir(parents=True)
    (pick / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"]}))
    (pick / "adapter_model.bin").write_bytes(b"\x80\x04junk")
    import shutil
    shutil.copytree(adapters_dir / "d-r16", root / "big")
    other = make_checkpoint(tmp_path / "other", "llama", hidden_size=32, intermediate_size=64)
    make_adapter(other, root / "mismatch", 2, 4, ["q_proj"], False, seed=9)
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root), max_lora_rank=8))
    with pytest.raises(AdapterError, match="pickle"):
        engine.add_request("p", [5], SamplingParams(max_tokens=1), adapter="pickled")
    with pytest.raises(AdapterError, match="rank 16, over"):
        engine.add_request("b", [5], SamplingParams(max_tokens=1), adapter="big")
    # shapes are only known once the tensors load (in the background): the request ends with an error
    engine.add_request("m", [5], SamplingParams(max_tokens=1), adapter="mismatch")
    outs = []
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        outs += engine.step()
        time.sleep(0.002)
    assert [(o.finish_reason, "does not fit this base model" in (o.error or "")) for o in outs] == [("abort", True)]
    engine.check_integrity()


def test_triton_lora_kernels_in_the_engine_match_peft(setup, monkeypatch):
    """Shrink/expand (and attention) on the Triton kernels, interpreted on the CPU."""
    monkeypatch.setenv("OMNIBUS_FORCE_TRITON", "1")
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir), max_loras=4))
    reqs = [(name, [9 + j, 40, 41 + j, 77], 3) for j, name in enumerate([None, "a-r2", "b-r8", "c-r4", "d-r16"])]
    for (adapter, prompt, n), out in zip(reqs, run(engine, reqs)):
        assert out == expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"


def test_host_tier_as_small_as_the_slots_keeps_a_new_adapter(setup):
    """max_cpu_loras == max_loras: a newly read adapter must not be evicted from host memory
    at once to make room (it would have no weights to fill its slot with)."""
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir),
                                 max_loras=1, max_cpu_loras=1))
    reqs = [("a-r2", [5, 6, 7], 3), ("b-r8", [5, 6, 7], 3), ("a-r2", [8, 9], 2)]
    for (adapter, prompt, n), out in zip(reqs, run(engine, reqs)):
        assert out == expected(oracles, adapter, prompt, n)


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_an_adapter_file_that_is_not_a_regular_file_is_refused_unread(setup, tmp_path, file, kind):
    """A FIFO's read blocks until a writer comes (safetensors' holding the GIL: the whole
    step loop froze, while health checks still said SERVING); a directory cannot be read."""
    base, adapters_dir, _ = setup
    bad = tmp_path / "root" / "odd"
    bad.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if name != file:
            (bad / name).write_bytes((adapters_dir / "a-r2" / name).read_bytes())
    (bad / file).mkdir() if kind == "directory" else os.mkfifo(bad / file)
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root")))
    with pytest.raises(AdapterError, match=f"{file} of adapter 'odd' is not a regular file"):
        engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter="odd")


def test_a_slot_refilled_with_a_smaller_adapter_keeps_nothing_of_the_old_one(setup):
    """b-r8 (rank 8, every projection) is evicted by a-r2 (rank 2, q and v only), which then
    runs in one batch with c-r4 (o, up, down): the batch applies q, v, o, up and down to
    a-r2's slot, so any rank tail or projection left over from b-r8 would change a-r2's
    tokens. Slot fills zero only what the old occupant leaves behind; PEFT decides."""
    base, adapters_dir, oracles = setup
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(adapters_dir),
                                 max_loras=2, max_cpu_loras=4))
    assert run(engine, [("b-r8", [5, 6, 7], 2)]) == [expected(oracles, "b-r8", [5, 6, 7], 2)]
    assert run(engine, [("c-r4", [5, 6, 7], 2)]) == [expected(oracles, "c-r4", [5, 6, 7], 2)]
    assert engine.adapters.inventory().resident == ("b-r8", "c-r4")
    engine.adapters.load("a-r2")
    deadline = time.monotonic() + 30
    while not engine.adapters.ready("a-r2") and time.monotonic() < deadline:  # in host memory first,
        time.sleep(0.002)  # so both requests join the same first step
    reqs = [("a-r2", [9, 40, 41, 77], 8), ("c-r4", [9, 40, 42, 77], 8)]
    for (adapter, prompt, n), out in zip(reqs, run(engine, reqs)):
        assert out == expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"
    assert engine.adapters.inventory().resident == ("a-r2", "c-r4")
    assert engine.adapters.stats().evictions == 1  # a-r2 took b-r8's slot


# target_modules as PEFT saves them beyond a list of projection names: "all-linear" (saved
# as the module paths it found), a regex, and module paths mixed with names (layer 0's q only).
TARGET_FORMS = {
    "all-linear": "all-linear",
    "regex": r".*\.(q_proj|down_proj)",
    "paths": ["model.layers.0.self_attn.q_proj", "v_proj"],
}


def test_target_modules_in_every_form_peft_saves_match_peft(setup, tmp_path):
    base, _, _ = setup
    root = tmp_path / "forms"
    oracles = {name: make_adapter(base, root / name, 4, 8, targets, False, seed=20 + i)
               for i, (name, targets) in enumerate(TARGET_FORMS.items())}
    saved = json.loads((root / "all-linear" / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.mlp.down_proj" in saved  # what the loader reads: paths, not "all-linear"
    oracles[None] = setup[2][None]
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root), max_loras=3))
    reqs = [(name, [9 + i, 40, 41, 77, 5], 6) for i, name in enumerate([*TARGET_FORMS, None])]
    for (adapter, prompt, n), out in zip(reqs, run(engine, reqs)):
        assert out == expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"
        if adapter is not None:
            assert out != expected(oracles, None, prompt, n)
    slots = engine.adapters._slots  # "paths" adapts q in layer 0 only, v everywhere
    assert slots.targets[slots.slot_of("paths")] == {"q_proj", "v_proj"}


@pytest.mark.parametrize(("targets", "error"), [
    (["q_proj", "lm_head"], r"targets \['lm_head'\]; supported"),
    (["model.embed_tokens"], r"targets \['model.embed_tokens'\]"),
    ("(unclosed", "not a valid regex"),
    ({"q_proj": 1}, "must be a list of module names or a regex"),
])  # fmt: skip
def test_target_modules_outside_the_projections_are_refused(setup, tmp_path, targets, error):
    base, adapters_dir, _ = setup
    bad = tmp_path / "root" / "bad"
    bad.mkdir(parents=True)
    (bad / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": targets}))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapters_dir / "a-r2" / "adapter_model.safetensors").read_bytes())
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root")))
    with pytest.raises(AdapterError, match=error):
        engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter="bad")


# PEFT's per-module overrides: a name, a layer's path and a regex, with and without rsLoRA;
# ranks above and below r. Where two keys match, the first in the saved file wins (PEFT
# saves them sorted), as in PEFT reloading the adapter: the oracle is that reloaded model.
PATTERNS = {
    "pattern": dict(rank_pattern={"q_proj": 6, r"layers\.1\.mlp\.down_proj": 2},
                    alpha_pattern={"v_proj": 24, r"model\.layers\.0\..*_proj": 3}),
    "pattern-rs": dict(rank_pattern={"up_proj": 1}, alpha_pattern={"o_proj": 2}),
}


def test_rank_and_alpha_patterns_match_peft(setup, tmp_path):
    base, _, _ = setup
    root = tmp_path / "patterns"
    all7 = ADAPTERS["b-r8"][2]
    import peft

    oracles = {}
    for i, (name, kw) in enumerate(PATTERNS.items()):
        make_adapter(base, root / name, 4, 8, all7, name.endswith("-rs"), seed=30 + i, **kw)
        oracles[name] = peft.PeftModel.from_pretrained(load_hf(base), root / name).eval()
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root), max_loras=2))
    reqs = [(name, [9 + i, 40, 41, 77, 5], 6) for i, name in enumerate(PATTERNS)]
    for (adapter, prompt, n), out in zip(reqs, run(engine, reqs)):
        assert out == expected(oracles, adapter, prompt, n), f"adapter {adapter} diverged"
    layer0 = oracles["pattern"].base_model.model.model.layers[0]
    assert layer0.self_attn.q_proj.r["default"] == 6  # the oracle really varies rank and scale:
    assert layer0.self_attn.q_proj.scaling["default"] == 3 / 6  # the layer-0 regex's alpha
    assert layer0.self_attn.v_proj.scaling["default"] == 3 / 4  # the regex sorts before "v_proj"
    assert oracles["pattern"].base_model.model.model.layers[1].self_attn.v_proj.scaling["default"] == 24 / 4


@pytest.mark.parametrize(("patterns", "error"), [
    ({"rank_pattern": {"q_proj": 0}}, r"rank_pattern\['q_proj'\] = 0 is not a rank"),
    ({"rank_pattern": {"q_proj": 64}}, "rank 64, over"),
    ({"alpha_pattern": {"(": 2}}, "alpha_pattern key '\\(' is not a valid regex"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern must be an object"),
])  # fmt: skip
def test_bad_rank_and_alpha_patterns_are_refused(setup, tmp_path, patterns, error):
    base, adapters_dir, _ = setup
    bad = tmp_path / "root" / "bad"
    bad.mkdir(parents=True)
    (bad / "adapter_config.json").write_text(json.dumps({"r": 2, "target_modules": ["q_proj"], **patterns}))
    (bad / "adapter_model.safetensors").write_bytes(
        (adapters_dir / "a-r2" / "adapter_model.safetensors").read_bytes())
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root"),
                                 max_lora_rank=16))
    with pytest.raises(AdapterError, match=error):
        engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter="bad")


def test_an_adapter_rewritten_on_disk_never_mixes_its_versions_in_the_prefix_cache(setup, tmp_path):
    """While loaded, an adapter serves (and salts the prefix cache as) the files it was read
    from; after an unload it is read again. KV computed with the old weights used to be
    salted as the new files', then served to them after the unload: neither version."""
    base, _, _ = setup
    import shutil

    spec = ADAPTERS["b-r8"]
    root = tmp_path / "rewrite"
    v1 = make_adapter(base, root / "x", *spec, seed=100)
    v2 = make_adapter(base, tmp_path / "v2", *spec, seed=200)
    prompt = [9, 40, 41, 77, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root), block_size=4))
    assert run(engine, [("x", prompt, 6)]) == [expected({"x": v1}, "x", prompt, 6)]
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copyfile(tmp_path / "v2" / name, root / "x" / name)
    assert run(engine, [("x", prompt, 6)]) == [expected({"x": v1}, "x", prompt, 6)]  # still loaded
    assert engine.adapters.unload("x")
    assert run(engine, [("x", prompt, 6)]) == [expected({"x": v2}, "x", prompt, 6)]


def _config_edit(src: Path, dst: Path, **changes) -> Path:
    """A copy of adapter `src` with adapter_config.json's keys changed (None: removed)."""
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((dst / "adapter_config.json").read_text())
    for key, value in changes.items():
        raw.pop(key, None) if value is None else raw.__setitem__(key, value)
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    return dst


def test_a_config_without_lora_alpha_gets_peft_s_default(setup, tmp_path):
    """PEFT reads a missing lora_alpha as 8 (LoraConfig's default), not as r."""
    import peft

    base, adapters_dir, _ = setup
    root = tmp_path / "root"
    _config_edit(adapters_dir / "a-r2", root / "noalpha", lora_alpha=None)
    oracle = peft.PeftModel.from_pretrained(load_hf(base), root / "noalpha").eval()
    assert oracle.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == 8 / 2
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(root)))
    prompt = [9, 40, 41, 77, 5]
    assert run(engine, [("noalpha", prompt, 6)]) == [expected({"noalpha": oracle}, "noalpha", prompt, 6)]


@pytest.mark.parametrize(("changes", "error"), [
    ({"alora_invocation_tokens": [40, 41]}, "uses alora_invocation_tokens \\(activated LoRA"),
    ({"layer_replication": [[1, 2], [0, 1]]}, "uses layer_replication"),
    ({"use_bdlora": {"nblocks": 2}}, "uses use_bdlora"),
    ({"trainable_token_indices": [5, 6]}, "uses trainable_token_indices"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa': loading it changes the base"),
    ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4'"),
    ({"init_lora_weights": "olora"}, "init_lora_weights='olora'"),
    ({"exclude_modules": 3}, "exclude_modules must be"),
    ({"layers_to_transform": ["0"]}, "layers_to_transform must be"),
])  # fmt: skip
def test_configs_peft_would_serve_differently_are_refused(setup, tmp_path, changes, error):
    """Each of these makes PEFT compute something else than base + B·A on every token."""
    base, adapters_dir, _ = setup
    _config_edit(adapters_dir / "a-r2", tmp_path / "root" / "bad", **changes)
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root")))
    with pytest.raises(AdapterError, match=error):
        engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter="bad")


def _load_error(engine: Engine, adapter: str) -> str:
    engine.add_request("x", [5], SamplingParams(max_tokens=1), adapter=adapter)
    outs = []
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        outs += engine.step()
        time.sleep(0.002)
    engine.check_integrity()
    assert [o.finish_reason for o in outs] == ["abort"]
    return outs[0].error


@pytest.mark.parametrize(("changes", "module"), [
    ({"target_modules": ["q_proj"]}, "model.layers.0.self_attn.v_proj"),  # a-r2 adapts q and v
    ({"exclude_modules": ["v_proj"]}, "model.layers.0.self_attn.v_proj"),
    ({"exclude_modules": r".*\.1\.self_attn\.q_proj"}, "model.layers.1.self_attn.q_proj"),
    ({"layers_to_transform": [0]}, "model.layers.1.self_attn.q_proj"),
])  # fmt: skip
def test_weights_of_modules_the_config_does_not_select_are_refused(setup, tmp_path, changes, module):
    """PEFT ignores them; serving them was silently another adapter."""
    base, adapters_dir, _ = setup
    _config_edit(adapters_dir / "a-r2", tmp_path / "root" / "extra", **changes)
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root")))
    assert f"holds weights for {module}, a module its adapter_config.json does not select" in _load_error(
        engine, "extra")


def test_trained_base_biases_are_named_in_the_refusal(setup, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    base, adapters_dir, _ = setup
    bad = tmp_path / "root" / "biased"
    shutil.copytree(adapters_dir / "a-r2", bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"] = torch.zeros(64)
    save_file(tensors, bad / "adapter_model.safetensors")
    engine = Engine(EngineConfig(model=str(base), dtype="float32", adapter_dir=str(tmp_path / "root")))
    assert "holds a trained base-model bias" in _load_error(engine, "biased")
