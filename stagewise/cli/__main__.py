"""`python -m stagewise.cli ...`: the `stagewise` script."""

from stagewise.cli.main import main

if __name__ == "__main__":
    main()
