"""Helpers of scripts/gpu_check.sh (the GPU path in one command that fits a device loan).

    python -m omnibus.bench.gpu_check versions --out OUT/versions.json [--smoke] [--budget S] [--parts ...]
    python -m omnibus.bench.gpu_check junit --out OUT/tests.xml FILE=RC:SECONDS:JUNIT ...

`versions` records the machine (device, driver, CUDA, torch, triton, transformers) and
whether this is a CPU smoke run; `junit` merges the per-file pytest reports into one file,
adding a failed case for each test file that its time cap killed or that left no report,
and prints a one-line count. Only the standard library and (for versions) torch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


def _run(cmd: list[str]) -> str | None:
    """A command's stripped stdout, or None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(dist: str) -> str | None:
    """An installed distribution's version, read without importing it (transformers alone
    takes seconds to import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _import_engine() -> str:
    """'ok (where from)', or why omnibus' engine does not import here (a missing wheel, say)."""
    try:
        import omnibus.bench.gpu  # noqa: F401
        import omnibus.engine.engine
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return f"ok ({Path(omnibus.engine.engine.__file__).parent.parent})"


def versions(smoke: bool) -> dict:
    notes = []
    try:
        import torch
    except ImportError as exc:  # recorded, so that the returned files say why nothing ran
        torch = None
        notes.append(f"torch does not import: {exc}")
    cuda = torch is not None and torch.cuda.is_available()
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if smi is None:
        notes.append("nvidia-smi not found or failed: no NVIDIA driver on this machine")
    nvcc = _run(["nvcc", "--version"])
    info: dict = {
        "smoke": smoke,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "device_count": torch.cuda.device_count() if cuda else 0,
        "driver": smi.splitlines()[0].split(", ")[1] if smi and ", " in smi else None,
        "nvidia_smi": smi,
        "cuda_runtime": torch.version.cuda if torch else None,
        "nvcc": nvcc.splitlines()[-1] if nvcc else None,
        "torch": torch.__version__ if torch else None,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "commit": _run(["git", "rev-parse", "--short", "HEAD"]),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "omnibus_import": _import_engine(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count)
    else:
        notes.append("no CUDA device: torch is the CPU build or sees no GPU")
    if smoke:
        notes.append("CPU smoke run: tiny shapes, every number is a code-path check, not a measurement")
    info["notes"] = notes
    return info


def merge_junit(files: list[str], out: Path) -> dict:
    """Merge `NAME=RC:SECONDS:JUNIT` per-file results into one <testsuites> file; returns counts."""
    root = ET.Element("testsuites")
    for spec in files:
        name, _, rest = spec.partition("=")
        rc_s, seconds_s, junit = rest.split(":", 2)
        rc, seconds = int(rc_s), float(seconds_s)
        suites = []
        if junit and Path(junit).is_file():
            try:
                tree = ET.parse(junit).getroot()
                suites = [tree] if tree.tag == "testsuite" else list(tree.iter("testsuite"))
            except ET.ParseError:
                suites = []
        for suite in suites:
            suite.set("file", name)
            root.append(suite)
        if rc in (124, 137) or not suites:
            why = (f"killed by its time cap after {seconds:.0f} s" if rc in (124, 137)
                   else f"pytest exited with code {rc} and wrote no report")
            suite = ET.SubElement(root, "testsuite", name=f"{name} (cut)", file=name, tests="1",
                                  failures="0", errors="1", skipped="0", time=f"{seconds:.1f}")
            case = ET.SubElement(suite, "testcase", classname=name, name="<file>", time=f"{seconds:.1f}")
            ET.SubElement(case, "error", message=why).text = why
    out.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(out, encoding="unicode", xml_declaration=True)
    return count(root)


def outcome(case: ET.Element) -> tuple[str, str]:
    """(outcome, message) of one <testcase>."""
    for tag in ("error", "failure", "skipped"):
        child = case.find(tag)
        if child is not None:
            message = child.get("message") or (child.text or "").strip()
            return {"failure": "failed"}.get(tag, tag), message
    return "passed", ""


def count(root: ET.Element) -> dict:
    counts = dict.fromkeys(OUTCOMES, 0)
    for case in root.iter("testcase"):
        counts[outcome(case)[0]] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("versions")
    v.add_argument("--out", type=Path, required=True)
    v.add_argument("--smoke", action="store_true")
    v.add_argument("--budget", type=int, default=None, help="the script's time budget in seconds")
    v.add_argument("--parts", default=None, help="the parts the script was asked to run")
    j = sub.add_parser("junit")
    j.add_argument("--out", type=Path, required=True)
    j.add_argument("files", nargs="*", help="NAME=RC:SECONDS:JUNIT_PATH per test file")
    args = ap.parse_args(argv)
    if args.cmd == "versions":
        info = versions(args.smoke)
        info.update(budget_s=args.budget, parts=args.parts.split(",") if args.parts else None)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(info, indent=2))
        print(f"device: {info['device']}; driver {info['driver']}; CUDA {info['cuda_runtime']}; "
              f"torch {info['torch']}; triton {info['triton']}; transformers {info['transformers']}"
              + ("; CPU SMOKE RUN" if args.smoke else ""))
        if not info["omnibus_import"].startswith("ok"):
            print(f"omnibus' engine does not import: {info['omnibus_import']}")
            return 1
        return 0
    counts = merge_junit(args.files, args.out)
    print("tests: " + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
