"""``python -m pflkit`` and the ``pflkit`` console script: the command line. The modules load
inside :func:`main`, so that a Ctrl-C while they do (torch takes a second or more) ends like one
anywhere else: one line, exit 130."""

import sys


def main() -> None:
    try:
        from pflkit.cli import main as cli_main
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C) while pflkit was starting: nothing ran", file=sys.stderr)
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
