"""The wheels that travel to the GPU machine: scripts/gpu_wheels.txt (the one list) against `.gpu-wheels/`."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging import tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

# the checkout the check runs from (scripts/gpu_check.sh sets KVSERVE_REPO, so an installed kvserve finds it)
REPO_ROOT = Path(os.environ.get("KVSERVE_REPO") or Path(__file__).resolve().parents[2])
LIST_PATH, DEFAULT_FOLDER = REPO_ROOT / "scripts" / "gpu_wheels.txt", REPO_ROOT / ".gpu-wheels"
TOKENIZER_DIR, TOKENIZER_REQUIRED = "smollm2-tokenizer", ("tokenizer.json", "tokenizer_config.json", "config.json")
WHEELS_LIMIT_MIB, TRAVEL_LIMIT_MIB = 60.0, 64.0  # the folder's weight; with the git-tracked files on the way
_LEGACY_GLIBC: dict[str, tuple[int, ...]] = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 50)] + [f"{p}_x86_64" for p in _LEGACY_GLIBC]
# every tag CPython 3.12 on a manylinux x86_64 image installs (any glibc: the real run checks that)
_GPU_TAGS = {*tags.cpython_tags((3, 12), None, _PLATFORMS), *tags.compatible_tags((3, 12), "cp312", _PLATFORMS)}


@dataclass(frozen=True, slots=True)
class Requirement:
    name: str
    version: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def parse_list(text: str) -> list[Requirement]:
    """`name==version` a line, `#` starts a comment; ValueError on anything else."""
    found: dict[str, Requirement] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", line)
        if line and match is None:
            raise ValueError(f"gpu_wheels.txt line {number}: expected NAME==VERSION, got {raw.strip()!r}")
        name = canonicalize_name(match[1]) if match else ""
        if name in found:
            raise ValueError(f"gpu_wheels.txt line {number}: {name} is listed twice")
        found |= {name: Requirement(name, match[2])} if match else {}
    if not found:
        raise ValueError("gpu_wheels.txt lists no wheels")
    return list(found.values())


def read_list(path: Path = LIST_PATH) -> list[Requirement]:
    return parse_list(path.read_text(encoding="utf-8"))


def installable(filename: str) -> bool:
    with contextlib.suppress(InvalidWheelFilename):
        return bool(parse_wheel_filename(filename)[3] & _GPU_TAGS)
    return False


def glibc_needed(filename: str) -> tuple[int, ...] | None:
    """The oldest glibc a manylinux tag of the wheel accepts (None: pure Python)."""
    platforms = [t.platform.removesuffix("_x86_64") for t in parse_wheel_filename(filename)[3]]
    found = [_LEGACY_GLIBC.get(p) or tuple(map(int, p.split("_")[1:3])) for p in platforms if "manylinux" in p]
    return min(found) if found else None


def _mib(paths: Iterable[Path]) -> float:
    return round(sum(p.stat().st_size for p in paths if p.is_file()) / 2**20, 2)


@dataclass(slots=True)
class FolderCheck:
    """What `.gpu-wheels/` holds against the list; `status` is ok, warning (no folder) or fail."""

    status: str
    folder: str
    listed: int
    exists: bool
    present: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    not_installable: list[str] = field(default_factory=list)
    unlisted: list[str] = field(default_factory=list)
    tokenizer_files: list[str] = field(default_factory=list)
    tokenizer_missing: list[str] = field(default_factory=list)
    size_mib: float = 0.0
    tracked_files_mib: float | None = None  # they travel with the folder; None outside a git checkout
    glibc_needed: str | None = None
    limit_mib: float = WHEELS_LIMIT_MIB
    messages: list[str] = field(default_factory=list)


def check_folder(folder: Path, requirements: list[Requirement]) -> FolderCheck:
    """Match every listed pin with an installable wheel in `folder` (which need not exist)."""
    try:
        git = ["git", "-C", str(REPO_ROOT), "ls-files", "-z"]
        listing = subprocess.run(git, capture_output=True, check=True, timeout=30)
        tracked = _mib(REPO_ROOT / name for name in listing.stdout.decode().split("\0") if name)
    except (OSError, subprocess.SubprocessError):
        tracked = None
    check = FolderCheck("warning", str(folder), len(requirements), folder.is_dir(), tracked_files_mib=tracked)
    if not check.exists:
        check.missing = [r.spec for r in requirements]
        check.messages.append(f"{folder} does not exist: run scripts/gpu_wheels.sh before a GPU run")
        return check
    wheels: dict[str, tuple] = {}
    for path in sorted(folder.glob("*.whl")):
        with contextlib.suppress(InvalidWheelFilename):
            wheels[path.name] = parse_wheel_filename(path.name)[:2]
    for req in requirements:
        matches = [f for f, pin in wheels.items() if pin == (req.name, Version(req.version))]
        good = [f for f in matches if installable(f)]
        check.present += good[:1]
        check.not_installable += [] if good else matches[:1]
        check.missing += [] if matches else [req.spec]
    pins = {(r.name, Version(r.version)) for r in requirements}
    check.unlisted = [f for f, pin in wheels.items() if pin not in pins]
    glibc = max(filter(None, map(glibc_needed, check.present)), default=None)
    check.glibc_needed = ".".join(map(str, glibc)) if glibc else None
    check.tokenizer_files = sorted(p.name for p in (folder / TOKENIZER_DIR).glob("*") if p.is_file())
    check.tokenizer_missing = [f"{TOKENIZER_DIR}/{n}" for n in TOKENIZER_REQUIRED if n not in check.tokenizer_files]
    check.size_mib = _mib(folder.rglob("*"))
    heavy = [f"{check.size_mib:.1f} MiB"] if check.size_mib >= WHEELS_LIMIT_MIB else []
    for what, names in (
        ("missing wheels", check.missing),
        ("not for cp312 manylinux x86_64", check.not_installable),
        ("missing tokenizer files", check.tokenizer_missing),
        ("not in the list (scripts/gpu_wheels.sh prunes them)", check.unlisted),
        (f"over the {WHEELS_LIMIT_MIB:g} MiB the folder may weigh", heavy),
    ):
        check.messages += [f"{what}: {', '.join(names)}"] if names else []
    check.status = "fail" if check.missing or check.not_installable or check.tokenizer_missing or heavy else "ok"
    return check


def main(argv: list[str] | None = None) -> int:
    """`specs` (for pip download), `check` or `prune` (delete the unlisted wheels) a folder."""
    parser = argparse.ArgumentParser(prog="python -m kvserve.gpu_check.wheel_list", description=__doc__)
    parser.add_argument("command", choices=("specs", "check", "prune"))
    parser.add_argument("folder", type=Path, nargs="?", default=DEFAULT_FOLDER)
    args = parser.parse_args(argv)
    if args.command == "specs":
        print("\n".join(r.spec for r in read_list()))
        return 0
    for name in check_folder(args.folder, read_list()).unlisted if args.command == "prune" else []:
        (args.folder / name).unlink()
        print(f"removed {name} (not in scripts/gpu_wheels.txt)")
    check = check_folder(args.folder, read_list())
    print(f"{check.folder}: {len(check.present)}/{check.listed} listed wheels, tokenizer files {check.tokenizer_files}")
    print(f"  {check.size_mib:.1f} MiB + {check.tracked_files_mib} MiB tracked files, of {TRAVEL_LIMIT_MIB:g} MiB")
    print("\n".join(f"  {message}" for message in check.messages))
    return 0 if check.status == "ok" and check.size_mib + (check.tracked_files_mib or 0.0) < TRAVEL_LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(main())
