"""The lab's entry point: `python profile_and_fuse.py [flags]` is `profuse [flags]`."""

import sys
from pathlib import Path

# Run from a checkout without installing: put src/ on the path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from profuse.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
