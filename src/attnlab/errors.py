"""Exceptions attnlab raises on purpose."""


class UserError(Exception):
    """An error in what the user asked for (a bad value, a missing file, no network for a download).

    The command line reports it as one line, without a traceback.
    """
