"""Regenerate (or check) the Python code of every `.proto` in the `kvserve.protos` package.

Two trees hold them: `kvserve/protos/kvserve/v1/` (the kvserve API and the executor link) and
`kvserve/protos/grpc/` (standard gRPC protocols that the installed grpcio packages lack, such as
server reflection v1), both under the repository's `protos/` folder.

    python -m kvserve.protos.generate          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py beside each .proto
    python -m kvserve.protos.generate --check  # exit 1 when the committed generated code is stale

protoc runs with `-I protos/`, the folder that holds the package under its import path, so a proto's
path is its module's path and the generated modules import each other as
`from kvserve.protos.kvserve.v1 import ...` with no rewriting (a proto's `package` statement need not
match it: `reflection.proto` declares `grpc.reflection.v1`).
`--check` generates into a temporary directory and compares, so it never touches the
working tree. The comparison ignores only the generator's version stamps (protoc and
grpcio-tools release numbers), so a newer grpcio-tools on a fresh clone does not flag
code whose content is unchanged; any other difference is stale.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

INCLUDE_ROOT = Path(__file__).resolve().parents[2]
"""protoc's include root: the folder that holds `kvserve/protos/` (the repository's `protos/`)."""
PACKAGE_DIR = Path("kvserve", "protos")
"""Every .proto below this folder of the include root is generated."""
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_VERSION_STAMPS = (
    re.compile(rb"# Protobuf Python Version: [^\n]*"),
    re.compile(rb"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)"),
    re.compile(rb"GRPC_GENERATED_VERSION = '[^']*'"),
)


class GenerationError(RuntimeError):
    """protoc rejected a .proto file."""


def proto_files() -> list[Path]:
    """Every .proto file that generation covers, relative to the include root, sorted."""
    return sorted(p.relative_to(INCLUDE_ROOT) for p in (INCLUDE_ROOT / PACKAGE_DIR).rglob("*.proto"))


def generated_names(proto: Path) -> list[Path]:
    """The generated files of one .proto, relative to the include root."""
    stem = proto.with_suffix("")
    return [stem.parent / (stem.name + suffix) for suffix in GENERATED_SUFFIXES]


def generate(out_root: Path) -> list[Path]:
    """Run protoc over every .proto, writing under `out_root`; return the generated paths."""
    from grpc_tools import protoc

    protos = proto_files()
    if not protos:
        return []
    include_dir = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{INCLUDE_ROOT}",
        f"-I{include_dir}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(INCLUDE_ROOT / p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise GenerationError(f"protoc failed on {', '.join(map(str, protos))}")
    return [name for proto in protos for name in generated_names(proto)]


def stale_files() -> list[Path]:
    """Generated files (relative paths) that are missing or differ from a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="kvserve-protos-") as tmp:
        fresh_root = Path(tmp)
        stale = []
        for name in generate(fresh_root):
            committed = INCLUDE_ROOT / name
            if not committed.is_file() or _content(committed) != _content(fresh_root / name):
                stale.append(name)
        return stale


def _content(path: Path) -> bytes:
    """The file's bytes with generator version stamps blanked out."""
    data = path.read_bytes()
    for stamp in _VERSION_STAMPS:
        data = stamp.sub(b"<version>", data)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvserve.protos.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the generated code is missing or stale"
    )
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale generated file: {name}", file=sys.stderr)
        if stale:
            print("run `make protos` (python -m kvserve.protos.generate) and commit the result", file=sys.stderr)
            return 1
        print(f"generated code is up to date ({len(proto_files())} .proto files)")
        return 0
    written = generate(INCLUDE_ROOT)
    for name in written:
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
