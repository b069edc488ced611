"""`python -m producer`: the same CLI as the `gpufeed` command."""

from producer.cli import main

if __name__ == "__main__":
    main()
