"""The test suite: a package, so pytest puts the repository root on sys.path (for `scripts` and `tests.support`)."""
