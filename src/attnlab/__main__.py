"""``python -m attnlab`` runs the command-line tool."""

from attnlab.cli import entry_point

if __name__ == "__main__":
    entry_point()
