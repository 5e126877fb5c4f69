"""`python -m graphcap` is the `graphcap` command."""

import sys

from graphcap.cli import main

sys.exit(main())
