"""Tests share the root conftest.py (8 virtual CPU devices); nothing more is needed here."""
