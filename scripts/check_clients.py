#!/usr/bin/env python3
"""`make check-clients`: lm-evaluation-harness and guidellm, unmodified, against Omnibus.

scripts/check_clients.sh installs the two tools in their own venv and runs this file with
the project's Python. It builds a small trained story checkpoint (scripts/build_demo_model.py,
a real tokenizer.json), serves it with an engine worker and a router with its OpenAI HTTP
front on loopback, and then:

1. lm-eval `local-completions` runs the two local tasks of tests/clients/ (a
   multiple_choice task: loglikelihood requests, echo + logprobs; a generate_until task)
   with --batch_size 4 against the router; lm-eval `hf` runs them on the same checkpoint
   in transformers. Each example's log-likelihoods must agree to LL_TOL, the
   is-greedy flags, the accuracies and the generated texts exactly.
2. guidellm runs the two scenarios of tests/clients/ (synchronous on /v1/completions,
   4 concurrent streams on /v1/chat/completions, both streamed), its tokenizer from the
   checkpoint folder; every request must succeed.

Nothing is downloaded at run time (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE). Every failure is
collected, printed and makes the exit status 1; a tool that exits non-zero stops the run
with the tail of its log.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "clients"
MC_TASK = "omnibus_story_choice"
GEN_TASK = "omnibus_story_continue"
LL_TOL = 1e-4  # float32 on both sides; different kernels and batch shapes
MODEL_NAME = "clients-demo"  # the id the router serves it under (/v1/models)
# A small story model trained for a few seconds: its choices and continuations are words,
# so accuracies mean something and greedy ties are unlikely.
BUILD_FLAGS = ("--steps", "200", "--hidden", "64", "--intermediate", "172", "--layers", "2",
               "--vocab-size", "512", "--sentences", "2000", "--block", "64")  # fmt: skip
ENGINE_FLAGS = ("--max-num-seqs", "8")
Json = dict[str, Any]  # a parsed report or sample
GUIDELLM_RUNS = (  # (name, scenario file, request format)
    ("synchronous", "guidellm_synchronous.json", "/v1/completions"),
    ("concurrent", "guidellm_concurrent.json", "/v1/chat/completions"),
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    model = build_checkpoint(out / "model")
    tools = Tools(args.clients_venv.resolve(), out)
    with serving(model, out / "logs") as url:
        tools.lm_eval("api", "local-completions", api_model_args(url))
        reports = {name: tools.guidellm(name, scenario, fmt, url, model)
                   for name, scenario, fmt in GUIDELLM_RUNS}  # fmt: skip
    tools.lm_eval("hf", "hf", f"pretrained={model},dtype=float32,add_bos_token=False")
    failures = compare_lm_eval(out / "lm-eval-api", out / "lm-eval-hf", out)
    for name, report in reports.items():
        failures += check_guidellm(name, report)
    print(f"\ncheck-clients: {time.monotonic() - started:.0f} s after the install")
    for failure in failures:
        print(f"FAIL: {failure}")
    print("check-clients: " + (f"{len(failures)} failure(s)" if failures else "OK"))
    return 1 if failures else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients-venv", type=Path, required=True, help="venv with lm_eval, guidellm")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "clients", help="work folder")
    return p.parse_args(argv)


def build_checkpoint(path: Path) -> Path:
    """The story checkpoint at `path`, built once (the builder renames a finished build into
    place, so an existing config.json means a whole checkpoint)."""
    if not (path / "config.json").exists():
        script = ROOT / "scripts" / "build_demo_model.py"
        run_logged([sys.executable, str(script), "--out", str(path), *BUILD_FLAGS],
                   path.parent / "logs" / "build-model.log")  # fmt: skip
    return path


@contextmanager
def serving(model: Path, log_dir: Path) -> Iterator[str]:
    """An engine worker and a router with its HTTP front, both ready; yields the base URL."""
    from omnibus.bench.processes import engine_and_router, free_port, wait_until

    port = free_port()
    router_flags = ("--http-port", str(port), "--model-name", MODEL_NAME)
    with engine_and_router(model, log_dir, ENGINE_FLAGS, router_flags):
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_ok(f"{url}/health"), 60, "the router's HTTP /health", poll=0.2)
        print(f"serving {model} as {MODEL_NAME} at {url} (logs in {log_dir})", flush=True)
        yield url


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


def api_model_args(url: str) -> str:
    """lm-eval's local-completions arguments: the tokenizer is the server's own (/tokenize,
    which lm-eval detects by itself); one try per request, so a refused one fails the run
    instead of being retried into a pass."""
    return f"model={MODEL_NAME},base_url={url}/v1/completions,max_retries=1,max_length=1024"


class Tools:
    """The two tools as subprocesses of the clients venv, offline, each logging to a file."""

    def __init__(self, venv: Path, out: Path) -> None:
        self.bin = venv / "bin"
        self.out = out
        self.env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HOME=str(out / "hf-home"),  # no user cache read or written
            NO_PROXY="127.0.0.1,localhost",
            no_proxy="127.0.0.1,localhost",
            TOKENIZERS_PARALLELISM="false",
        )

    def lm_eval(self, name: str, model: str, model_args: str) -> None:
        dest = self.out / f"lm-eval-{name}"
        shutil.rmtree(dest, ignore_errors=True)
        cmd = [str(self.bin / "lm_eval"), "run", "--model", model, "--model_args", model_args,
               "--include_path", str(TASK_DIR), "--tasks", MC_TASK, GEN_TASK,
               "--batch_size", "4", "--device", "cpu", "--log_samples",
               "--output_path", str(dest)]  # fmt: skip
        run_logged(cmd, self.out / "logs" / f"lm-eval-{name}.log", env=self.env, show_tail=8)

    def guidellm(self, name: str, scenario: str, fmt: str, url: str, model: Path) -> Json:
        report = self.out / f"guidellm-{name}.json"
        report.unlink(missing_ok=True)
        cmd = [str(self.bin / "guidellm"), "run", "--scenario", str(TASK_DIR / scenario),
               "--backend", f"kind=openai_http,target={url},model={MODEL_NAME},"
               f"request_format={fmt}",
               "--tokenizer", f"kind=huggingface_auto,model={model}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]  # fmt: skip
        run_logged(cmd, self.out / "logs" / f"guidellm-{name}.log", env=self.env)
        parsed: Json = json.loads(report.read_text())
        return parsed


def run_logged(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, show_tail: int = 0
) -> None:
    """Runs `cmd` from the repository root with its output in `log`; exits with the log's
    tail when it fails (a tool's error ends the check: nothing after it is meaningful)."""
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    lines = log.read_text(errors="replace").splitlines()
    if code != 0:
        sys.exit("\n".join([*lines[-60:], f"FAIL: {cmd[0]} exited with {code} (log: {log})"]))
    print("\n".join(lines[-show_tail:]) if show_tail else "", flush=True)


# ---------------------------------------------------------------- lm-eval comparison


def compare_lm_eval(api_dir: Path, hf_dir: Path, out: Path) -> list[str]:
    """Failures where lm-eval's local-completions run differs from its hf run."""
    api_results, hf_results = results(api_dir), results(hf_dir)
    failures = compare_metrics(api_results, hf_results)
    failures += compare_loglikelihoods(samples(api_dir, MC_TASK), samples(hf_dir, MC_TASK), out)
    failures += compare_generations(samples(api_dir, GEN_TASK), samples(hf_dir, GEN_TASK))
    return failures


def results(folder: Path) -> Json:
    by_task: Json = json.loads(Path(only(folder, "results_*.json")).read_text())["results"]
    return by_task


def samples(folder: Path, task: str) -> dict[int, Json]:
    lines = Path(only(folder, f"samples_{task}_*.jsonl")).read_text().splitlines()
    return {doc["doc_id"]: doc for doc in map(json.loads, lines)}


def only(folder: Path, pattern: str) -> str:
    """The one file matching `pattern` under `folder` (lm-eval adds a folder per model)."""
    found = glob.glob(str(folder / "**" / pattern), recursive=True)
    if len(found) != 1:
        sys.exit(f"FAIL: expected one {pattern} under {folder}, found {found}")
    return found[0]


def compare_metrics(api: Json, hf: Json) -> list[str]:
    print("\nlm-eval metrics        local-completions   hf")
    failures = []
    for task, metric in ((MC_TASK, "acc"), (MC_TASK, "acc_norm"), (GEN_TASK, "exact_match")):
        a, h = api[task][f"{metric},none"], hf[task][f"{metric},none"]
        print(f"  {task} {metric}: {a:.4f}  {h:.4f}")
        if a != h:
            failures.append(f"{task} {metric}: local-completions {a} != hf {h}")
    return failures


def compare_loglikelihoods(api: dict[int, Json], hf: dict[int, Json], out: Path) -> list[str]:
    """Each (example, choice)'s log-likelihood within LL_TOL and its is-greedy flag equal;
    all of them are written to loglikelihoods.tsv beside the runs."""
    if api.keys() != hf.keys():
        return [f"{MC_TASK}: examples differ: {sorted(api)} vs {sorted(hf)}"]
    rows = ["doc\tchoice\tlocal_completions\thf\tdelta\tgreedy_api\tgreedy_hf"]
    failures, worst = [], 0.0
    for doc_id in sorted(api):
        pairs = zip(api[doc_id]["resps"], hf[doc_id]["resps"], strict=True)
        for choice, (((a_ll, a_greedy),), ((h_ll, h_greedy),)) in enumerate(pairs):
            delta = abs(float(a_ll) - float(h_ll))
            worst = max(worst, delta)
            rows.append(f"{doc_id}\t{choice}\t{a_ll}\t{h_ll}\t{delta:.3g}\t{a_greedy}\t{h_greedy}")
            if delta > LL_TOL or a_greedy != h_greedy:
                failures.append(f"{MC_TASK} doc {doc_id} choice {choice}: local-completions "
                                f"({a_ll}, greedy {a_greedy}) vs hf ({h_ll}, greedy {h_greedy}), "
                                f"|delta| {delta:.3g}")  # fmt: skip
    (out / "loglikelihoods.tsv").write_text("\n".join(rows) + "\n")
    print(f"  {MC_TASK}: {len(rows) - 1} log-likelihoods, max |delta| {worst:.3g} "
          f"(tolerance {LL_TOL}; each in {out / 'loglikelihoods.tsv'})")  # fmt: skip
    return failures


def compare_generations(api: dict[int, Json], hf: dict[int, Json]) -> list[str]:
    if api.keys() != hf.keys():
        return [f"{GEN_TASK}: examples differ: {sorted(api)} vs {sorted(hf)}"]
    failures = []
    for doc_id in sorted(api):
        a, h = api[doc_id]["resps"][0][0], hf[doc_id]["resps"][0][0]
        print(f"  {GEN_TASK} doc {doc_id}: {a!r}" + ("" if a == h else f" (hf: {h!r})"))
        if a != h:
            failures.append(f"{GEN_TASK} doc {doc_id}: local-completions {a!r} != hf {h!r}")
    return failures


# ---------------------------------------------------------------- guidellm report


def check_guidellm(name: str, report: Json) -> list[str]:
    """Failures of one guidellm run (any errored or incomplete request, or none at all);
    prints its request counts, TTFT and ITL."""
    failures = []
    for bench in report["benchmarks"]:
        totals = bench["metrics"]["request_totals"]
        ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
        itl = bench["metrics"]["inter_token_latency_ms"]["successful"]
        print(f"\nguidellm {name} ({bench['config']['strategy']['type_']}): requests "
              f"{totals['successful']} ok, {totals['errored']} errored, {totals['incomplete']} "
              f"incomplete; TTFT median {ttft['median']:.1f} ms p95 "
              f"{ttft['percentiles']['p95']:.1f} ms; ITL median {itl['median']:.2f} ms p95 "
              f"{itl['percentiles']['p95']:.2f} ms")  # fmt: skip
        if totals["errored"] or totals["incomplete"] or not totals["successful"]:
            failures.append(f"guidellm {name}: {totals}")
    return failures or ([] if report["benchmarks"] else [f"guidellm {name}: no benchmark ran"])


if __name__ == "__main__":
    sys.exit(main())
