"""Shared test code: tiny models and references, files of each kind, the server harness. Imported as
`helpers.<module>` (tests/ is on sys.path through tests/conftest.py)."""
