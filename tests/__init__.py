"""The test suite, a package so that its groups (``tests/<area>/``) and helpers (``tests.helpers``) import by their
full names from the repository root."""
