"""The demo checkpoint builder (scripts/build_demo_model.py) makes a loadable HF model.

Builds use --train-seconds 0 / tiny --steps so the whole file runs in seconds; the
real (trained) build is `python scripts/build_demo_model.py`.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_demo_model.py"
# Small enough to build in well under a second; exercises GQA (2 heads, 1 KV head).
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
        "--intermediate", "64", "--sentences", "600", "--vocab-size", "400",
        "--batch", "4", "--block", "32"]
TEXTS = ["Once upon a time there was a little fox.", "café ☕", "  two  spaces\tand\nlines ",
         'The fox said, "Hi !" .']


def load_builder() -> ModuleType:
    """Import the script by path: scripts/ is not a package."""
    spec = importlib.util.spec_from_file_location("build_demo_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @dataclass looks its module up while executing
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builder() -> ModuleType:
    return load_builder()


@pytest.fixture
def build(builder: ModuleType, tmp_path: Path):
    """Run the builder in-process, restoring the torch thread count it changes."""
    threads = torch.get_num_threads()

    def run(*args: str, out: Path | None = None) -> Path:
        out = out or tmp_path / "demo"
        assert builder.main(["--out", str(out), *args]) == 0
        return out

    yield run
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_build(builder: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Default sizes with random weights. In-process (main takes the CLI's argv) to
    avoid paying torch + transformers imports twice."""
    out = tmp_path_factory.mktemp("cli") / "demo"
    threads = torch.get_num_threads()
    try:
        assert builder.main(["--train-seconds", "0", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_writes_a_complete_checkpoint(default_build: Path) -> None:
    names = {p.name for p in default_build.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not default_build.with_name("demo.tmp").exists()
    config = json.loads((default_build / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["max_position_embeddings"] == 1024
    assert config["tie_word_embeddings"] is False
    assert 1000 <= config["vocab_size"] <= 2000
    # chat on the demo: the messages' text as one story, rendered as transformers renders it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_build)
    text = tok.apply_chat_template([{"role": "user", "content": "Once upon a time"},
                                    {"role": "user", "content": "there was"}], tokenize=False)
    assert text == "<s>Once upon a time there was"


def test_transformers_loads_and_generates(default_build: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_build)
    model = AutoModelForCausalLM.from_pretrained(default_build)
    ids = tok("Once upon a time", return_tensors="pt")
    # The post-processor adds exactly one <s>, as in training.
    assert ids["input_ids"][0].tolist().count(tok.bos_token_id) == 1
    assert ids["input_ids"][0, 0].item() == tok.bos_token_id
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(default_build: Path, text: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(default_build / "tokenizer.json"))
    assert raw.decode(raw.encode(text).ids) == text
    hf = AutoTokenizer.from_pretrained(default_build)
    assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == text


def test_special_token_ids_match_config(default_build: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((default_build / "config.json").read_text())
    gen = json.loads((default_build / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(default_build)
    assert config["eos_token_id"] == gen["eos_token_id"] == tok.convert_tokens_to_ids("</s>")
    assert config["bos_token_id"] == gen["bos_token_id"] == tok.convert_tokens_to_ids("<s>")
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"


def test_same_seed_builds_identical_files(build, tmp_path: Path) -> None:
    a = build(*TINY, "--steps", "2", out=tmp_path / "a")
    b = build(*TINY, "--steps", "2", out=tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = build(*TINY, "--steps", "2", "--seed", "1", out=tmp_path / "c")
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_rebuild_replaces_old_output_and_stale_tmp(build, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    stale_tmp = tmp_path / "demo.tmp"
    stale_tmp.mkdir()
    (stale_tmp / "config.json").write_text("{half written")
    build(*TINY, "--train-seconds", "0", out=out)
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert not stale_tmp.exists() and not (tmp_path / "demo.old").exists()


def test_corpus_is_seeded_english_stories(builder: ModuleType) -> None:
    corpus = builder.build_corpus(200, seed=3)
    assert corpus == builder.build_corpus(200, seed=3)
    assert corpus != builder.build_corpus(200, seed=4)
    assert all(s.startswith("Once upon a time") and s.endswith((".", '"')) for s in corpus)
    assert " a owl" not in " ".join(corpus)  # articles agree with the noun
