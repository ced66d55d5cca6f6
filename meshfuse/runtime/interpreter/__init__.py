"""interpreter."""
