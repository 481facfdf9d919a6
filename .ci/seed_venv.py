"""Seed a new virtual environment with hard links to the distributions another one already has
at exactly the versions a constraints file pins, so that pip finds them installed.

The ms-swift stage's environment shares torch 2.13.0 (750 MB), numpy, scipy, pandas, pyarrow and
more with the main one; pip would unpack every file again (about 30 s for torch alone on the
project's 2-core machine, far more under load), a hard link costs nothing and the bytes are the
same wheel's. Only files under site-packages that the distribution's RECORD lists are linked
(console scripts in bin/ are not: they name the other interpreter). A distribution whose files
cannot all be linked (another filesystem, a missing file) is removed again and left to pip.
Afterwards `pip install -c constraints` installs the rest and `pip check` judges the whole.

    python3 .ci/seed_venv.py --from .venv --into .venv-swift --constraints constraints-swift.txt
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
from pathlib import Path


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"--from/--into: expected one lib/python3*/site-packages under {venv}, found {len(found)}")
    return found[0]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(constraints: Path) -> dict[str, str]:
    pins = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if match:
            pins[_canonical(match.group(1))] = match.group(2)
    return pins


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def seed(source: Path, target: Path, constraints: Path) -> list[str]:
    source_site, target_site = _site_packages(source), _site_packages(target)
    pins = _pins(constraints)
    linked = []
    for info in sorted(source_site.glob("*.dist-info")):
        metadata = info / "METADATA"
        record = info / "RECORD"
        if not metadata.is_file() or not record.is_file():
            continue
        fields = dict(line.split(": ", 1) for line in metadata.read_text(errors="replace").splitlines()[:10] if ": " in line)
        name, version = _canonical(fields.get("Name", "")), fields.get("Version", "")
        if name not in pins or _public(pins[name]) != _public(version) or (target_site / info.name).exists():
            continue
        with record.open(newline="") as handle:
            paths = [row[0] for row in csv.reader(handle) if row]
        inside = [p for p in paths if not p.startswith("..") and not os.path.isabs(p)]
        made = []
        try:
            for relative in inside:
                destination = target_site / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.link(source_site / relative, destination)
                made.append(destination)
        except OSError as error:
            for path in made:
                path.unlink(missing_ok=True)
            print(f"seed_venv: {name} {version} left to pip ({error})", file=sys.stderr)
            continue
        linked.append(f"{name}=={version}")
    return linked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, required=True)
    parser.add_argument("--into", dest="target", type=Path, required=True)
    parser.add_argument("--constraints", type=Path, required=True)
    args = parser.parse_args()
    if not (args.source / "bin" / "python").exists():
        print(f"seed_venv: no environment at {args.source}; pip installs everything", file=sys.stderr)
        return 0
    linked = seed(args.source, args.target, args.constraints)
    print(f"seed_venv: linked {len(linked)} distributions from {args.source}: {' '.join(linked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
