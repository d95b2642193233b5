"""`python -m stagewise ...`: the `stagewise` command (the same as `python -m stagewise.cli`)."""

from stagewise.cli import main

if __name__ == "__main__":
    main()
