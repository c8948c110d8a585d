"""Public MSA API (being written)."""
__all__ = []
