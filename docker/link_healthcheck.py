"""Container healthcheck for the executor: healthy once its link to the scheduler is connected.

Reads /proc/net/tcp{,6} (no extra tools in the image) for an ESTABLISHED connection with
the link port at either end. Usage: python link_healthcheck.py PORT; exit 0 when found.
"""

from __future__ import annotations

import sys
from pathlib import Path

TCP_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
ESTABLISHED = "01"


def has_established(port: int, tables: tuple[Path, ...] = TCP_TABLES) -> bool:
    for table in tables:
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4 or fields[3] != ESTABLISHED:
                continue
            local_port, remote_port = (int(address.rsplit(":", 1)[1], 16) for address in fields[1:3])
            if port in (local_port, remote_port):
                return True
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: link_healthcheck.py PORT", file=sys.stderr)
        return 2
    return 0 if has_established(int(argv[0])) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
