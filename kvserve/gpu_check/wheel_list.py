"""The wheels that travel to the GPU machine: parse `scripts/gpu_wheels.txt`, check `.gpu-wheels/`.

The text file is the one list; the download script, the dry run and the real run all read
it. A folder passes when it holds, for every entry, a wheel of that name and pinned version
that CPython 3.12 on manylinux x86_64 can install, plus the SmolLM2 tokenizer files. Standard
library only: this runs before anything is installed.

`python -m kvserve.gpu_check.wheel_list check|prune|install ...` is what the shell scripts call.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(os.environ.get("KVSERVE_REPO") or Path(__file__).resolve().parents[2])
"""The checkout the check runs from: scripts/gpu_check.sh sets KVSERVE_REPO, so an installed kvserve finds
the wheel list and the carried folders too; by default the folder above this package (a checkout)."""
LIST_PATH = REPO_ROOT / "scripts" / "gpu_wheels.txt"
DEFAULT_FOLDER = REPO_ROOT / ".gpu-wheels"
TOKENIZER_DIR = "smollm2-tokenizer"
TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer_config.json", "config.json")
TOKENIZER_OPTIONAL = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")
TRAVEL_LIMIT_MIB = 64.0
"""Git-tracked files plus carried ignored folders may weigh this much on the way to the GPU machine."""
WHEELS_LIMIT_MIB = 60.0
"""The folder must stay well under this, leaving room for the tracked files."""

IMAGE_PROVIDES = frozenset(
    {"torch", "triton", "transformers", "tokenizers", "huggingface-hub", "safetensors", "numpy", "pyyaml", "requests"}
)
"""What the GPU image brings (with their own dependencies): never shipped, never shadowed."""
NOT_NEEDED_ON_GPU = frozenset({"matplotlib", "accelerate", "grpcio-tools", "ruff", "mypy", "import-linter"})
"""Declared by pyproject.toml but not imported by the GPU run: plots, unused, protoc, lint."""

_PURE_PYTHON_TAGS = ("py3", "py312", "py2")
_PLATFORM = re.compile(r"^(any|manylinux\w*_x86_64)$")


def normalize(name: str) -> str:
    """PEP 503 name normalisation: `Typing_Extensions` and `typing-extensions` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, slots=True)
class Requirement:
    name: str
    version: str | None
    line: int

    @property
    def spec(self) -> str:
        return self.name if self.version is None else f"{self.name}=={self.version}"


@dataclass(frozen=True, slots=True)
class WheelFile:
    """A wheel's file name split into its parts (PEP 427)."""

    path: Path
    name: str
    version: str
    python_tags: tuple[str, ...]
    abi_tags: tuple[str, ...]
    platform_tags: tuple[str, ...]

    @classmethod
    def parse(cls, path: Path) -> WheelFile | None:
        parts = path.name.removesuffix(".whl").split("-")
        if not path.name.endswith(".whl") or len(parts) not in (5, 6):
            return None
        name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
        return cls(path, normalize(name), version, tuple(py.split(".")), tuple(abi.split(".")), tuple(plat.split(".")))

    @property
    def installable(self) -> bool:
        """Installable by CPython 3.12 on manylinux x86_64 (the GPU image): pure Python, built
        for cp312, or built for the stable ABI (abi3) of a CPython up to 3.12."""
        return any(_PLATFORM.match(t) for t in self.platform_tags) and any(
            self._python_ok(py, abi) for py in self.python_tags for abi in self.abi_tags
        )

    @staticmethod
    def _python_ok(python_tag: str, abi_tag: str) -> bool:
        if python_tag in _PURE_PYTHON_TAGS:
            return abi_tag == "none"
        match = re.fullmatch(r"cp3(\d+)", python_tag)
        if match is None:
            return False
        minor = int(match.group(1))
        return (minor == 12 and abi_tag in ("cp312", "none")) or (minor <= 12 and abi_tag == "abi3")

    @property
    def glibc(self) -> tuple[int, int] | None:
        """The newest glibc a manylinux tag of this wheel asks for (None: pure Python)."""
        versions = []
        for tag in self.platform_tags:
            legacy = {"manylinux1_x86_64": (2, 5), "manylinux2010_x86_64": (2, 12), "manylinux2014_x86_64": (2, 17)}
            match = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag)
            if match:
                versions.append((int(match.group(1)), int(match.group(2))))
            elif tag in legacy:
                versions.append(legacy[tag])
        return min(versions) if versions else None


def parse_list(text: str) -> list[Requirement]:
    """`name==version` (or a bare name) a line; `#` starts a comment. ValueError on anything else."""
    found: list[Requirement] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==([A-Za-z0-9.+!_-]+))?", line)
        if match is None:
            raise ValueError(f"gpu_wheels.txt line {number}: expected NAME==VERSION, got {raw.strip()!r}")
        name = normalize(match.group(1))
        if name in seen:
            raise ValueError(f"gpu_wheels.txt line {number}: {name} is listed twice")
        seen.add(name)
        found.append(Requirement(name, match.group(2), number))
    if not found:
        raise ValueError("gpu_wheels.txt lists no wheels")
    return found


def read_list(path: Path = LIST_PATH) -> list[Requirement]:
    return parse_list(path.read_text(encoding="utf-8"))


@dataclass(slots=True)
class FolderCheck:
    """What `.gpu-wheels/` holds against the list; `status` is ok, warning (no folder) or fail."""

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
    tracked_mib: float | None = None
    glibc: tuple[int, int] | None = None
    """The newest glibc a listed wheel needs (the real run compares it with the image's)."""
    messages: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        if not self.exists:
            return "warning"
        problems = self.missing or self.not_installable or self.tokenizer_missing
        return "fail" if problems or self.size_mib >= WHEELS_LIMIT_MIB else "ok"

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "folder": self.folder,
            "listed": self.listed,
            "exists": self.exists,
            "present": self.present,
            "missing": self.missing,
            "not_installable": self.not_installable,
            "unlisted": self.unlisted,
            "tokenizer_files": self.tokenizer_files,
            "tokenizer_missing": self.tokenizer_missing,
            "size_mib": round(self.size_mib, 2),
            "tracked_files_mib": None if self.tracked_mib is None else round(self.tracked_mib, 2),
            "glibc_needed": None if self.glibc is None else ".".join(map(str, self.glibc)),
            "limit_mib": WHEELS_LIMIT_MIB,
            "messages": self.messages,
        }


def folder_size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def check_folder(folder: Path, requirements: list[Requirement]) -> FolderCheck:
    """Match every listed requirement with a wheel in `folder` (the folder need not exist)."""
    result = FolderCheck(folder=str(folder), listed=len(requirements), exists=folder.is_dir())
    if not result.exists:
        result.messages.append(f"{folder} does not exist: run scripts/gpu_wheels.sh before a GPU run")
        result.missing = [r.spec for r in requirements]
        return result
    wheels = [w for w in (WheelFile.parse(p) for p in sorted(folder.glob("*.whl"))) if w is not None]
    listed: set[Path] = set()
    for req in requirements:
        matches = [w for w in wheels if w.name == req.name and (req.version is None or w.version == req.version)]
        listed.update(w.path for w in matches)
        good = [w for w in matches if w.installable]
        if good:
            result.present.append(good[0].path.name)
            result.glibc = max([result.glibc, good[0].glibc], key=lambda v: v or (0, 0))
        elif matches:
            result.not_installable.append(matches[0].path.name)
        else:
            result.missing.append(req.spec)
    result.unlisted = [w.path.name for w in wheels if w.path not in listed]
    tokenizer = folder / TOKENIZER_DIR
    result.tokenizer_files = sorted(p.name for p in tokenizer.glob("*") if p.is_file()) if tokenizer.is_dir() else []
    result.tokenizer_missing = [f"{TOKENIZER_DIR}/{n}" for n in TOKENIZER_REQUIRED if n not in result.tokenizer_files]
    result.size_mib = folder_size_mib(folder)
    if result.missing:
        result.messages.append(f"missing wheels: {', '.join(result.missing)} (run scripts/gpu_wheels.sh)")
    if result.not_installable:
        result.messages.append(f"not for cp312 manylinux x86_64: {', '.join(result.not_installable)}")
    if result.tokenizer_missing:
        result.messages.append(f"missing tokenizer files: {', '.join(result.tokenizer_missing)}")
    if result.unlisted:
        result.messages.append(f"not in the list (scripts/gpu_wheels.sh --prune removes them): {len(result.unlisted)}")
    if result.size_mib >= WHEELS_LIMIT_MIB:
        result.messages.append(f"{result.size_mib:.1f} MiB: over the {WHEELS_LIMIT_MIB:g} MiB the folder may weigh")
    return result


def install_by_unzipping(wheels: list[Path], target: Path) -> None:
    """`pip install --no-deps --target`, for an image without pip: a wheel is a zip of its files.

    `*.data/purelib` and `*.data/platlib` go to the target too; scripts and headers are skipped.
    """
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                parts = Path(member.filename).parts
                if parts and parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    relative = Path(*parts[2:])
                else:
                    relative = Path(member.filename)
                if member.is_dir() or ".." in relative.parts:
                    continue
                destination = target / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as source, open(destination, "wb") as sink:
                    shutil.copyfileobj(source, sink)


def tracked_files_mib(repo: Path = REPO_ROOT) -> float | None:
    """Size of the git-tracked files (they travel with the wheels); None outside a git checkout."""
    import subprocess

    try:
        listing = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = (repo / name for name in listing.decode().split("\0") if name)
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvserve.gpu_check.wheel_list", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "prune"):
        p = sub.add_parser(name, help="validate the folder" if name == "check" else "delete unlisted wheels")
        p.add_argument("folder", type=Path, nargs="?", default=DEFAULT_FOLDER)
    p = sub.add_parser("specs", help="print the list as pip requirement specs, one a line")
    p = sub.add_parser("install", help="unzip wheels into a target folder (when the image has no pip)")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("wheels", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "specs":
        print("\n".join(r.spec for r in read_list()))
        return 0
    if args.command == "install":
        install_by_unzipping(args.wheels, args.target)
        return 0
    check = check_folder(args.folder, read_list())
    if args.command == "prune":
        for name in check.unlisted:
            (args.folder / name).unlink()
            print(f"removed {name} (not in scripts/gpu_wheels.txt)")
        check = check_folder(args.folder, read_list())
    check.tracked_mib = tracked_files_mib()
    total = check.size_mib + (check.tracked_mib or 0.0)
    print(
        f"{check.folder}: {len(check.present)}/{check.listed} listed wheels, "
        f"tokenizer files {', '.join(check.tokenizer_files) or 'none'}; "
        f"{check.size_mib:.1f} MiB (+ {check.tracked_mib or 0.0:.1f} MiB tracked files = {total:.1f} MiB "
        f"of the {TRAVEL_LIMIT_MIB:g} MiB that may travel)"
    )
    for message in check.messages:
        print(f"  {message}")
    return 0 if check.status == "ok" and total < TRAVEL_LIMIT_MIB else 1


if __name__ == "__main__":
    sys.exit(_main())
