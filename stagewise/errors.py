"""One error type for everything a user can get wrong.

`StagewiseError` is a `ValueError`, so the API raises a `ValueError` with a
one-line message; the CLI catches it, prints the message and exits with 2.
"""


class StagewiseError(ValueError):
    """Bad input from the user: an unknown model, an empty prompt, a bad parameter."""
