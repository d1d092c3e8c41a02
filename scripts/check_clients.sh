#!/usr/bin/env bash
# `make check-clients` (issue 33): lm-evaluation-harness and guidellm, installed from the
# package index into their own venv and run unmodified against a router + engine serving a
# small story checkpoint (scripts/check_clients.py does the serving, running and comparing).
# Not part of `make test`: it needs the package index the first time (the install took
# 35 s to 2 min here), then runs offline in 1 to 4 minutes on 2 cores (the first run also
# trains the checkpoint, ~20 s).
#
# The venv gets torch first, pinned, from the CPU wheel on this machine's find-links; the
# tools then install under a constraint that keeps it, so pip never resolves a newer torch
# (whose default build pulls gigabytes of CUDA wheels).
#
# Environment: PY (the project's Python, default .venv/bin/python), PYTHON (creates the
# clients venv, default python3), CLIENTS_VENV (default build/clients-venv), CLIENTS_OUT
# (logs, reports and the checkpoint; default build/clients).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}
VENV=${CLIENTS_VENV:-build/clients-venv}
OUT=${CLIENTS_OUT:-build/clients}
TORCH=torch==2.13.0
TOOLS=("lm-eval[api,hf]==0.4.13" "guidellm==0.8.1")

# One stamp per set of pins: changing a version above reinstalls the venv from scratch.
stamp="$VENV/.installed-$(echo "$TORCH ${TOOLS[*]}" | md5sum | cut -c1-8)"
if [ ! -f "$stamp" ]; then
  echo "installing $TORCH ${TOOLS[*]} into $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH"
  echo "$TORCH" > "$VENV/constraints.txt"
  "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "${TOOLS[@]}"
  touch "$stamp"
fi

exec "$PY" scripts/check_clients.py --clients-venv "$VENV" --out "$OUT"
