"""The server's defaults that its command line shows: in a module of their own, so that `serve --help` reads
them without importing torch or the server's dependencies."""

DEFAULT_MAX_BATCH = 16  # completions decoded together (`serve --max-batch`)
DEFAULT_MAX_REQUEST_MB = 16  # the largest body read (`serve --max-request-mb`)
