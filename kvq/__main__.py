"""`python -m kvq`: the same command line as `kvq`."""

from kvq.cli.app import main

if __name__ == "__main__":
    main()
