"""The command line: one module per command, each thin (load the inputs, call one library
function, print a rich table or JSON). ``app`` builds the parser and dispatches."""

from autoconf.cli.app import main

__all__ = ["main"]
