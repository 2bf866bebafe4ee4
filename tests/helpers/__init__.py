"""What the tests share that is not a fixture: models whose bytes are computable by hand, counts of memory that share
no code with memkit, readers of the files a run writes, and processes run with a timeout. Imported as
``tests.helpers.<module>``; fixtures and hooks live in ``tests/conftest.py``."""
