"""User-facing errors: one `error:` line on stderr, exit code 2, no traceback."""

import difflib


class UserError(Exception):
    """Bad input from the user (flags, config, rules, data). The CLI prints it and exits 2."""


def closest(name: str, choices) -> str:
    """' (did you mean X?)' for the closest of `choices`, or ''."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""
