"""CLI subcommands, one module each (discovered by actlake.cli)."""
