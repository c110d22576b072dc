"""`python -m kvserve.executor ...`: one executor process, as `kvserve serve` starts it.

The same flags as `kvserve executor`, without importing the `kvserve` CLI package.
"""

from __future__ import annotations

import sys

from kvserve.executor.entry import main

if __name__ == "__main__":
    sys.exit(main())
