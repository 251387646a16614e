"""fusefs: pack small-file training sets into chunks and serve them back through FUSE."""
__version__ = "0.1.0"
