"""`python -m attnkit.cli` runs the `attnkit` command."""

import sys

from attnkit.cli import main

sys.exit(main())
