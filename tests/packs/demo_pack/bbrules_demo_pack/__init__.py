"""A demonstration rule pack: the .bbr files next to this module."""
