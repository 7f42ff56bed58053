"""Shared helpers, fakes and child-process runners of the test suite; the tests import them, they never import a test.

Each module's docstring says what it fakes or starts. tests/ is on sys.path (child_runs.prepare), so they are
imported as ``support.<module>``."""
