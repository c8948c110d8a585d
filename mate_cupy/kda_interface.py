"""Public KDA API (being written)."""
__all__ = []
