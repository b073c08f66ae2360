"""One error type for everything the user can fix; the CLI prints it as one line and exits 1."""

import click


class HvdgenError(click.ClickException):
    """A problem the user can fix. The message names the problem and what to do."""
