#!/usr/bin/env python3
"""Build the small demo Llama checkpoint that `make run` serves by default.

A fresh CPU machine has no model and possibly no network, so we synthesise one:

1. A seeded probabilistic English grammar writes a corpus of short stories.
2. A byte-level BPE tokenizer (`tokenizers` library) is trained on that corpus.
   Byte-level means every UTF-8 string is representable, so decode(encode(t)) == t
   for any text, including text the corpus never contained ("café ☕").
3. A Llama-architecture model (GQA, untied embeddings) is trained on CPU for a
   time budget, long enough that greedy decoding produces grammatical words.
4. Everything is written as a standard Hugging Face checkpoint into DIR.tmp and
   then renamed to DIR, so an interrupted build never leaves a half model behind.

Tokenizer conventions (engine code relies on these):
- `<s>` (bos) and `</s>` (eos) are the only special tokens; their ids are stored in
  config.json and generation_config.json as bos_token_id / eos_token_id.
- The tokenizer's post-processor prepends `<s>` when `add_special_tokens=True`
  (the default for `tokenizer(text)`), matching how the model was trained: every
  story in the corpus is `<s> story </s>`.
- Decoding with `skip_special_tokens=True` drops `<s>`/`</s>` and restores the text
  exactly; `clean_up_tokenization_spaces` is off so " ." is not rewritten to ".".

Usage:
    python scripts/build_demo_model.py                      # models/demo, ~150 s
    python scripts/build_demo_model.py --train-seconds 0    # random weights, fast
    python scripts/build_demo_model.py --steps 300          # bit-reproducible training

Determinism: the corpus, tokenizer, initial weights and batch order depend only on
--seed, so `--train-seconds 0` and `--steps N` builds are byte-identical for a given
seed (and thread count). With a time budget the number of optimiser steps, and so
the final weights, depends on how fast the machine is.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

BOS = "<s>"
EOS = "</s>"
PROMPT = "Once upon a time"


# --------------------------------------------------------------------------- grammar

ANIMALS = ["fox", "rabbit", "bear", "cat", "dog", "owl", "mouse", "duck", "frog", "deer",
           "squirrel", "turtle", "bird", "lion", "pig", "goat", "horse", "sheep", "cow",
           "hedgehog", "badger", "otter", "wolf", "tiger", "monkey", "elephant", "giraffe",
           "penguin", "kitten", "puppy", "bee", "butterfly", "snail", "beaver", "raccoon",
           "hen", "donkey", "panda", "koala", "whale", "dolphin", "crab", "spider", "ant"]
NAMES = ["Tom", "Lily", "Max", "Anna", "Ben", "Sue", "Sam", "Mia", "Leo", "Zoe", "Tim",
         "Lucy", "Jack", "Emma", "Noah", "Ella", "Finn", "Ruby", "Oscar", "Daisy", "Hugo",
         "Rosie", "Milo", "Poppy", "Felix", "Nora", "Theo", "Ivy", "Jasper", "Hazel"]
SIZE_ADJS = ["little", "big", "small", "tiny", "young", "old", "tall", "short", "fat",
             "thin", "fluffy", "spotted", "striped"]
MOOD_ADJS = ["happy", "curious", "brave", "kind", "shy", "clever", "sleepy", "funny",
             "gentle", "grumpy", "silly", "lonely", "busy", "friendly", "polite", "wise",
             "lazy", "cheerful", "careful", "naughty", "quiet", "proud"]
COLOURS = ["green", "red", "blue", "yellow", "brown", "white", "golden", "dark", "purple",
           "orange", "pink", "grey", "silver", "sunny", "snowy", "shady", "peaceful"]
PLACES = ["forest", "meadow", "village", "garden", "valley", "house", "farm", "town",
          "field", "hill", "castle", "cave", "island", "river bank", "mountain", "park",
          "pond", "beach", "jungle", "barn", "orchard", "desert", "swamp", "city", "lake"]
OBJECTS = ["ball", "box", "hat", "kite", "book", "flower", "stone", "key", "shell",
           "apple", "cake", "drum", "boat", "lamp", "map", "bell", "basket", "blanket",
           "cup", "feather", "coin", "ring", "scarf", "toy", "candle", "umbrella", "carrot",
           "cookie", "pencil", "shoe", "rope", "sock", "honey pot", "leaf", "egg", "crown",
           "whistle", "mirror", "letter", "pie", "balloon", "jar", "spoon", "banana"]
DAILY = ["played in the {place}", "looked for food", "sang a song", "ran to the river",
         "climbed a tall tree", "talked to the birds", "picked flowers",
         "went for a long walk", "read a book", "helped its mother", "slept in the sun",
         "watched the clouds", "swam in the pond", "baked bread", "counted the stars",
         "danced in the rain", "painted pictures", "dug holes in the ground",
         "jumped over rocks", "visited its grandmother", "played with its brother",
         "cleaned its little house", "collected shiny stones", "chased butterflies",
         "drank water from the stream", "told stories to its friends"]
FEELINGS = ["happy", "sad", "scared", "excited", "surprised", "worried", "proud", "tired",
            "angry", "lonely", "hungry", "thankful", "nervous", "sorry", "glad", "upset"]
FRIEND_ACTS = ["played together", "shared the {obj}", "went home together",
               "had a picnic", "laughed and danced", "looked at the stars",
               "built a little house", "sat by the river", "ate some cake",
               "sang a happy song", "played hide and seek", "made a big sandcastle",
               "flew the kite", "went on an adventure", "told funny jokes",
               "cooked soup for dinner", "planted a tree", "walked back home"]
PROBLEMS = ["The {obj} was stuck in a tall tree.", "The {hero} could not find the way home.",
            "A big storm came to the {place}.", "The {obj} fell into the river.",
            "The {obj} was broken.", "The {hero} heard a strange noise.",
            "The bridge over the river was gone.", "The {friend} was crying.",
            "It was getting dark and cold."]
SOLUTIONS = ["looked under every rock", "asked the wise old owl for help",
             "built a bridge with sticks", "used a long rope", "followed the bright moon",
             "waited until the rain stopped", "fixed it with glue and string",
             "climbed up very slowly", "called all their friends", "thought very hard"]
WEATHER = ["The sun was bright.", "It was a cold morning.", "The wind was strong.",
           "It started to rain.", "The sky was blue and clear.", "It was a warm night.",
           "Snow was falling softly.", "The moon was big and round.",
           "The birds were singing in the trees.", "The leaves were red and yellow."]
SAYINGS = ["Can you help me?", "Let us be friends!", "I like your {obj}.",
           "Where are you going?", "Look at this!", "Thank you, my friend.",
           "Do not be scared.", "I am lost.", "What a beautiful day!",
           "May I play with you?", "I am sorry.", "This is my {obj}.",
           "Why are you sad?", "We can do it together!", "Wait for me!",
           "Have you seen my {obj}?", "I will help you.", "Good morning!"]
ENDINGS = ["From that day on, the {a} and the {b} were best friends.",
           "In the end, everyone was happy.",
           "The {a} learned that it is good to share.",
           "That night, the {a} went to sleep with a big smile.",
           "And they lived happily ever after.",
           "The {a} never forgot that day.",
           "The {a} learned that friends help each other.",
           "Now the {a} and the {b} play together every day.",
           "The {a} was proud and happy.",
           "It was the best day ever.",
           "The {b} gave the {a} a big hug.",
           "After that, the {a} was never lonely again."]


def with_article(word: str) -> str:
    """'a' or 'an' so the model never learns 'a owl'."""
    return ("an " if word[0] in "aeiou" else "a ") + word


@dataclass
class Cast:
    """Who and where, drawn once per story so later sentences refer back consistently."""
    hero: str
    friend: str
    place: str
    obj: str


def pick_cast(rng: random.Random) -> Cast:
    hero, friend = rng.sample(ANIMALS, 2)
    return Cast(hero=hero, friend=friend, place=rng.choice(PLACES), obj=rng.choice(OBJECTS))


def opening(rng: random.Random, c: Cast) -> str:
    adj = rng.choice(SIZE_ADJS + MOOD_ADJS)
    where = with_article(f"{rng.choice(COLOURS)} {c.place}")
    if rng.random() < 0.3:
        name = rng.choice(NAMES)
        return f"Once upon a time there was {with_article(adj)} {c.hero} named {name}. " \
               f"{name} lived in {where}."
    return f"Once upon a time there was {with_article(adj)} {c.hero} who lived in {where}."


def routine(rng: random.Random, c: Cast) -> str:
    act = rng.choice(DAILY).format(place=c.place)
    when = rng.choice(["Every day", "Every morning", "Each evening", "Most days"])
    return f"{when} the {c.hero} {act}."


def event(rng: random.Random, c: Cast) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        thing = f"{rng.choice(COLOURS)} {c.obj}"
        return f"One day, the {c.hero} found {with_article(thing)} near the {c.place}."
    if kind == 1:
        return f"One day, the {c.hero} met {with_article(rng.choice(MOOD_ADJS))} {c.friend}."
    return f"One day, the {c.hero} lost its {c.obj} in the {c.place}."


def middle(rng: random.Random, c: Cast) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return f"The {c.hero} was very {rng.choice(FEELINGS)}."
    if kind == 1:
        said = rng.choice(SAYINGS).format(obj=c.obj)
        speaker = rng.choice([c.hero, c.friend])
        return f"The {speaker} said, \"{said}\""
    if kind == 2:
        return rng.choice(WEATHER)
    if kind == 3:
        problem = rng.choice(PROBLEMS).format(obj=c.obj, hero=c.hero, friend=c.friend,
                                              place=c.place)
        return f"{problem} So the {c.hero} and the {c.friend} {rng.choice(SOLUTIONS)}."
    act = rng.choice(FRIEND_ACTS).format(obj=c.obj)
    return f"The {c.hero} and the {c.friend} {act}."


def ending(rng: random.Random, c: Cast) -> str:
    return rng.choice(ENDINGS).format(a=c.hero, b=c.friend)


def story(rng: random.Random) -> list[str]:
    """One short story as a list of sentences (opening, routine, event, middles, end)."""
    c = pick_cast(rng)
    middles = [middle(rng, c) for _ in range(rng.randint(1, 4))]
    return [opening(rng, c), routine(rng, c), event(rng, c), *middles, ending(rng, c)]


def build_corpus(num_sentences: int, seed: int) -> list[str]:
    """Stories until at least num_sentences sentences; one story per string."""
    rng = random.Random(seed)
    stories: list[str] = []
    count = 0
    while count < num_sentences:
        sentences = story(rng)
        stories.append(" ".join(sentences))
        count += len(sentences)
    return stories


# ------------------------------------------------------------------------- tokenizer

def build_tokenizer(corpus: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with <s>/</s>; the full byte alphabet makes any text encodable."""
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would break exact round-tripping.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Prepend <s> like the training data does; no </s> so prompts stay open-ended.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def tokenizer_config(max_len: int) -> dict:
    """tokenizer_config.json that makes AutoTokenizer load tokenizer.json verbatim.

    tokenizer_class is set explicitly: otherwise transformers would pick the Llama
    tokenizer from model_type and rebuild a SentencePiece-style pipeline around our
    vocab, which would not round-trip.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,  # no dedicated pad token; padding positions must be masked
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        # A story model has no roles: a chat is the story so far, the messages' text in
        # order, continued by the model (so /v1/chat/completions works on the demo).
        "chat_template": DEMO_CHAT_TEMPLATE,
    }


DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %} {% endif %}{% endfor %}"
)


def encode_corpus(tok: Tokenizer, corpus: list[str]) -> torch.Tensor:
    """All stories as one token stream: <s> story </s> <s> story </s> ..."""
    eos_id = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(corpus):  # post-processor already adds <s>
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- model

def make_model(args: argparse.Namespace, tok: Tokenizer) -> LlamaForCausalLM:
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        do_sample=False, max_new_tokens=64,
    )
    return model


# -------------------------------------------------------------------------- training

def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, cosine decay to 10% of peak as progress -> 1."""
    warm = min(1.0, (step + 1) / warmup)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def sample_batch(data: torch.Tensor, batch: int, block: int, gen: torch.Generator):
    """Random contiguous windows; inputs and next-token targets."""
    starts = torch.randint(0, len(data) - block - 1, (batch,), generator=gen)
    x = torch.stack([data[s:s + block] for s in starts])
    y = torch.stack([data[s + 1:s + block + 1] for s in starts])
    return x, y


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D params), as is standard for transformers."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def progress(step: int, elapsed: float, args: argparse.Namespace) -> float:
    """Fraction of training done: by step count with --steps, else by wall clock.

    Measuring by wall clock lets the cosine schedule finish exactly when the budget
    runs out however fast (or contended) the CPU is; --steps trades that for exact
    reproducibility.
    """
    if args.steps is not None:
        return step / args.steps
    return elapsed / args.train_seconds


def train(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Train until progress reaches 1; returns the final smoothed loss."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(model, args.lr)
    model.train()
    start, step, smoothed = time.monotonic(), 0, float("nan")
    while (done := progress(step, time.monotonic() - start, args)) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, done, args.lr, args.warmup)
        loss = train_step(model, opt, *sample_batch(data, args.batch, args.block, gen))
        smoothed = loss if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * loss
        log_progress(step, loss, smoothed, time.monotonic() - start)
        step += 1
    print(f"trained {step} steps ({step * args.batch * args.block} tokens) in "
          f"{time.monotonic() - start:.1f}s; final loss {smoothed:.3f}")
    model.eval()
    return smoothed


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
               x: torch.Tensor, y: torch.Tensor) -> float:
    logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item()


def log_progress(step: int, loss: float, smoothed: float, elapsed: float) -> None:
    """Sparse loss curve: powers of two early, then every 25 steps."""
    if (step & (step - 1)) == 0 or step % 25 == 0:
        print(f"step {step:5d}  loss {loss:.3f}  (smoothed {smoothed:.3f})  {elapsed:6.1f}s",
              flush=True)


# ---------------------------------------------------------------------------- output

def sample_text(model: LlamaForCausalLM, tok: Tokenizer, prompt: str = PROMPT,
                max_new_tokens: int = 48) -> str:
    """Greedy continuation of `prompt`, the same check a user of `make run` would do."""
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def save_checkpoint(model: LlamaForCausalLM, tok: Tokenizer, directory: Path,
                    max_len: int) -> None:
    """config.json, generation_config.json, model.safetensors, tokenizer files."""
    model.save_pretrained(directory, safe_serialization=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(max_len), indent=2) + "\n"
    )


def publish(tmp: Path, out: Path) -> None:
    """Swap the finished build into place; `out` is always absent or complete."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def write_atomically(model: LlamaForCausalLM, tok: Tokenizer, out: Path, max_len: int) -> None:
    """Build in OUT.tmp, then swap it in: `make` keys on OUT existing."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted build
    tmp.mkdir(parents=True)
    save_checkpoint(model, tok, tmp, max_len)
    publish(tmp, out)


# ------------------------------------------------------------------------------- cli

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-seconds", type=float, default=150.0,
                   help="training time budget; 0 keeps random weights")
    p.add_argument("--steps", type=int, default=None,
                   help="train exactly this many steps (overrides the time budget)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    p.add_argument("--sentences", type=int, default=6000, help="corpus size")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128, help="training sequence length")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    return p.parse_args(argv)


def wants_training(args: argparse.Namespace) -> bool:
    if args.steps is not None:
        return args.steps > 0
    return args.train_seconds > 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # "Writing model shards" bars clutter the log
    t0 = time.monotonic()
    corpus = build_corpus(args.sentences, args.seed)
    tok = build_tokenizer(corpus, args.vocab_size)
    data = encode_corpus(tok, corpus)
    print(f"corpus: {len(corpus)} stories, {len(data)} tokens, vocab {tok.get_vocab_size()}")
    model = make_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    if wants_training(args):
        train(model, data, args)
    print(f"sample: {sample_text(model, tok)!r}")
    write_atomically(model, tok, args.out, args.max_positions)
    print(f"wrote {args.out} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
