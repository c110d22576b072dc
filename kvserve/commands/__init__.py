"""One module per `kvserve` subcommand; see kvserve.cli."""
