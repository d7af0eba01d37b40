"""One module per ``moecompile`` subcommand (see ``moecompile/cli.py``)."""
