"""The command line's subcommands that sit on a whole package: their options, data and printing
(``private-engine probe``: :mod:`.probe`; ``private-engine audit``: :mod:`.audit`), kept out of
the library packages they drive."""
