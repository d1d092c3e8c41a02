#!/usr/bin/env python3
"""Type-check with mypy (configured in pyproject.toml's [tool.mypy]), strict on the
packages listed there (engine core and the shared rules at least).

    make typecheck                          # the same as:
    .venv/bin/python scripts/typecheck.py   # extra arguments go to mypy

mypy resolves imports by file path, and the package-dir mapping (`router/` installs as
`omnibus.router`, `protos/omnibus/common` as `omnibus.common`) is invisible to it: the
editable install reaches those folders through an import hook that only Python runs. So
this lays out build/typecheck/omnibus/, a tree of symbolic links that mirrors the mapping
(build/typecheck/omnibus/router -> router/, ...), which [tool.mypy]'s mypy_path points at,
and runs mypy; messages name the real files (router/x.py, not the links).
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "typecheck"


def lay_out_links(root: Path = ROOT, tree: Path = TREE) -> dict[Path, Path]:
    """Links under `tree` for pyproject's package-dir mapping; returns {link: folder}.
    Folders mapped under another mapped one (omnibus.router inside omnibus) become links
    inside a real folder standing for the outer one, beside links to its own entries."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    links = {}
    for name, folder in mapping.items():
        inner = [other for other in mapping if other.startswith(name + ".")]
        if not inner:
            links[tree.joinpath(*name.split("."))] = root / folder
            continue
        taken = {other.split(".")[name.count(".") + 1] for other in inner}
        for entry in sorted((root / folder).iterdir()):
            if entry.name not in taken and entry.name != "__pycache__":
                links[tree.joinpath(*name.split("."), entry.name)] = entry
    shutil.rmtree(tree, ignore_errors=True)  # removes the links, never what they point at
    for link, target in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
    return links


def main(argv: list[str]) -> int:
    from mypy import api

    links = lay_out_links()
    os.chdir(ROOT)
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), *argv])
    for link, target in sorted(links.items(), key=lambda item: -len(str(item[0]))):
        out = out.replace(f"{link.relative_to(ROOT)}", f"{target.relative_to(ROOT)}")
    sys.stdout.write(out)
    sys.stderr.write(err)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
