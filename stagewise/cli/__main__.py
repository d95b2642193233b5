"""`python -m stagewise.cli ...`: the `stagewise` script."""

from stagewise.cli import main

if __name__ == "__main__":
    main()
