"""The one class of error a user can fix: bad input, a broken packed folder, a busy or dead
mount point. The `fusefs` command catches it once, prints `fusefs COMMAND: message` and
exits with its exit_code; every module raises a subclass of it that names its concern."""


class UserError(Exception):
    exit_code = 2
