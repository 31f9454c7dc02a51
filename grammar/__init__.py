"""Grammars of the program (.bbp), block-program (.bbk) and rule (.bbr) languages, as data."""
