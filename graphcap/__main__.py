"""`python -m graphcap` is the `graphcap` command."""

from graphcap.cli import console_main

console_main()
