"""The standard rule pack: the .bbr files in this directory."""
