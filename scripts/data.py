"""`python scripts/data.py ...` is `spmd-data ...` without installing the entry point."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from spmd.cli.data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
