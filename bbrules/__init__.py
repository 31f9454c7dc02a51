"""bbrules: block-level operator fusion for AI inference programs."""

__version__ = "0.1.0"
