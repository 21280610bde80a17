"""The command line: argv only, one module per command, the entry point and its error policy."""
