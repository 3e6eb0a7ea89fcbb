"""The base of every error a user can fix (bad config, data, checkpoint): the CLI prints it as one line
and exits with its `exit_code`."""


class UserError(Exception):
    exit_code = 2


class Stopped(UserError):
    """Training stopped on a signal (SIGTERM from a scheduler, SIGINT from Ctrl-C) once its state was
    saved; exit 128 + the signal's number, as a shell reports a process killed by it (143, 130)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum
