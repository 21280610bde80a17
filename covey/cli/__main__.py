"""`python -m covey.cli`: the same as the `covey` command."""

import sys

from covey.cli.main import entry

sys.exit(entry())
