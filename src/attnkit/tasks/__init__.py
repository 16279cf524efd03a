"""Embedded tasks that need no download: data for the demo and the tests."""
