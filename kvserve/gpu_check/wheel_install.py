"""The carried wheels installed on the GPU machine, into a folder put first on the stages' PYTHONPATH."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


def install_wheels(folder: Path, site: Path) -> str:
    """`pip install --no-index --no-deps --target site` of the folder's wheels, else unzipped (a wheel is a zip)."""
    wheels = [str(p) for p in sorted(folder.glob("*.whl"))]
    if not wheels:
        return "no wheels"
    shutil.rmtree(site, ignore_errors=True)
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, check=False).returncode == 0:
        pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps", "-q"]
        try:
            done = subprocess.run([*pip, "--target", str(site), *wheels], timeout=180, check=False)
        except subprocess.TimeoutExpired:
            return "pip timed out"
        return "pip" if done.returncode == 0 else "pip failed"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.infolist():
                parts = Path(member.filename).parts
                if parts[0].endswith(".data"):  # only *.data/purelib and platlib belong in site-packages
                    parts = parts[2:] if len(parts) > 2 and parts[1] in ("purelib", "platlib") else ()
                if parts and not member.is_dir() and ".." not in parts:
                    site.joinpath(*parts).parent.mkdir(parents=True, exist_ok=True)
                    site.joinpath(*parts).write_bytes(archive.read(member))
    return "unzip"
