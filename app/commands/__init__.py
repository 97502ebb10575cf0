"""One module per `skrull` subcommand; each exposes `add_arguments(parser)` and `run(args) -> int`."""
