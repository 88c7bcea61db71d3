"""The one exception type a user can cause; the CLI prints its message and exits with status 2."""


class UserError(Exception):
    """Bad input that the user can fix. The message says what is wrong and how to fix it."""
