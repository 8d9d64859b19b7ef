"""The ``runlane`` command's exit codes (``runlane --help`` lists them)."""

__all__ = ["EXIT_CONFIGURATION", "EXIT_FAILURE", "EXIT_FORCED", "EXIT_PIPE"]

EXIT_FAILURE = 1  # a runtime failure: the database, the schema, a failed worker or service
EXIT_CONFIGURATION = 2  # a usage or configuration error (argparse uses 2 as well)
EXIT_FORCED = 3  # a second SIGTERM/SIGINT: exited at once, runs left to lease expiry
EXIT_PIPE = 141  # stdout closed by the reader (`runlane status APP | head -1`), as SIGPIPE
