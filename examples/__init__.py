"""Runnable examples; each is run by a test."""
