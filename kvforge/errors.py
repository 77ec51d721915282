"""The one error type kvforge raises for problems a user can fix.

Messages carry the offending values (names, shapes, paths) so that the user
does not have to re-run anything to learn what was wrong.
"""


class KvforgeError(Exception):
    """A problem with the user's input, files or environment, stated plainly."""


class MissingDependencyError(KvforgeError):
    """An optional library or device that a feature needs is not available."""

    def __init__(self, what: str, install: str):
        super().__init__(f"{what} is not available. {install}")
        self.what = what
        self.install = install
