"""The base of every error a user can fix (bad config, data, checkpoint): the CLI prints it as one line."""


class UserError(Exception):
    pass
