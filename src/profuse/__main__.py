import sys

from profuse.cli import main

sys.exit(main())
