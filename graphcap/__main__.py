"""`python -m graphcap` is the `graphcap` command.

`python -m` puts the current directory first on `sys.path`, where a stray `torch.py` or
`yaml.py` would shadow the installed package; the console script has no such entry. Drop
it, so both entry points import the same code (factory modules are still found in the
current directory: `graphcap.models.load_factory` searches it last).
"""

import os
import sys

if not getattr(sys.flags, "safe_path", False) and sys.path and os.path.abspath(sys.path[0] or ".") == os.getcwd():
    del sys.path[0]

from graphcap.cli import console_main

console_main()
