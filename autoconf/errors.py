"""The one error type for bad user input.

The CLI turns a :class:`UserError` into a single line on stderr and exit code 2; anything else is a
bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user: the message names the offending value and what would be valid."""
