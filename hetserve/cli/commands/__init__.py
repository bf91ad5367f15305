"""One module per ``hetserve`` subcommand; each defines ``register(subparsers)``."""
